"""The one error taxonomy of splitflow: what went wrong, whose it is, and whether a retry can help.

Every anticipated failure raises a subclass of :class:`SplitflowError`.  Its message is one line
that names the file, row, key or path and says what to do.  Two families, told apart by who
must act:

* :class:`InputError` (exit code 2) -- the user's input: a config value, a data row or file, a
  cache or checkpoint that does not fit this run.  Running again cannot help, so it is never
  retried (``retryable = False``); the user fixes the named thing.
* :class:`EnvironmentFailure` (exit code 3) -- the machine or the services around it: disk
  full, permissions, network, a Prefect server that is down, a lock another process holds.
  Often transient, so retryable unless a subclass or instance says otherwise.

A third, :class:`Interrupted` (exit code 130), is no failure: Ctrl-C or SIGTERM stopped the work,
also when a library caught the signal's exception and raised its own around it.  A local run
never retries it; on a pool worker it means the worker was stopped, and the coordinator runs the
work again elsewhere (``flows/observe.failure_kind``).

Anything else that escapes is a bug (exit code 1).  The CLI maps these classes to exit codes in
one place (``flows/cli.py``); the coordinator reads ``retryable`` to decide on re-submission.

This module imports nothing, so ``cache_store`` and ``stages`` can raise these types too.
"""

from __future__ import annotations

import contextlib
import errno
import re

EXIT_OK = 0
EXIT_BUG = 1
EXIT_INPUT = 2
EXIT_ENVIRONMENT = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for Ctrl-C


class SplitflowError(Exception):
    """Base of every anticipated failure; ``str(err)`` is the one line shown to the user."""

    exit_code = EXIT_BUG
    retryable = True

    def __init__(self, message: str = "", *, retryable: bool | None = None):
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class InputError(SplitflowError, ValueError):
    """The user's input is wrong (config, data, cache, checkpoint): fix it; a retry cannot help.

    A ``ValueError`` too, so callers that caught ``ValueError`` before the taxonomy existed
    still catch it.
    """

    exit_code = EXIT_INPUT
    retryable = False


class EnvironmentFailure(SplitflowError):
    """The environment failed (disk, permissions, network, server, a held lock)."""

    exit_code = EXIT_ENVIRONMENT
    retryable = True


class Interrupted(SplitflowError):
    """Ctrl-C or SIGTERM stopped the work: nothing to fix, what was written is kept; re-run to resume."""

    exit_code = EXIT_INTERRUPTED
    retryable = False  # the user asked to stop: a retry would carry on against their wish


class LockHeldError(EnvironmentFailure):
    """Another live process holds the lock on an output folder or cache part (message names it)."""


# errno values that mean the machine, not the user's input, is at fault.  A full disk or a
# read-only folder does not heal by itself within a retry's backoff: not retryable.
_NOT_RETRYABLE_ERRNO = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
_ENVIRONMENT_ERRNO = _NOT_RETRYABLE_ERRNO | {errno.EIO, errno.ENOMEM, errno.EMFILE, errno.ENFILE,
                                             errno.ETIMEDOUT, errno.ECONNREFUSED, errno.ECONNRESET,
                                             errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EPIPE}
_ERRNO_ADVICE = {
    errno.ENOSPC: "the disk is full: free space (or point output.path / cache.url elsewhere) and re-run",
    errno.EDQUOT: "the disk quota is exhausted: free space and re-run",
    errno.EROFS: "the file system is read-only: point output.path / cache.url at a writable folder",
    errno.EACCES: "permission denied: make the folder writable for this user or choose another",
    errno.EPERM: "operation not permitted: make the folder writable for this user or choose another",
}


def classify(exc: BaseException) -> SplitflowError | None:
    """The taxonomy's view of an exception raised by a library (``OSError``, connection errors).

    Returns the exception itself when it already is a :class:`SplitflowError`, a new one (whose
    message names the path when the OS gave one) for failures of the environment, and None for
    anything else (a bug, exit code 1).  Walks ``__cause__``/``__context__`` so a wrapped disk-full
    error (safetensors, zarr) is still recognised, and so is a wrapped interrupt: a signal's
    exception raised inside a library callback comes back as the library's error (pydantic:
    ``PydanticSerializationError`` caused by the ``KeyboardInterrupt``).
    """
    chain = _chain(exc)
    if any(is_interrupt(current) for current in chain):  # first: the user stopped it, whatever broke after
        return Interrupted("interrupted; work written so far is kept, re-run to resume")
    for current in chain:
        if isinstance(current, SplitflowError):
            return current
        if isinstance(current, ConnectionError) or type(current).__name__ in ("ConnectError", "ConnectTimeout"):
            return EnvironmentFailure(f"network: {current}")
        code = _os_errno(current)
        if code in _ENVIRONMENT_ERRNO:
            filename = getattr(current, "filename", None)
            where = f"{filename}: " if filename else ""
            advice = _ERRNO_ADVICE.get(code, getattr(current, "strerror", None) or str(current))
            return EnvironmentFailure(f"{where}{advice}", retryable=code not in _NOT_RETRYABLE_ERRNO)
    if any(_SHORT_WRITE.search(str(current)) for current in chain):  # no errno anywhere in the chain
        return EnvironmentFailure("a file write stopped short (torch: unexpected pos): the disk is most likely "
                                  "full; free space (or point output.path elsewhere) and re-run", retryable=False)
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it wraps (``__cause__``, else ``__context__``), outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def is_interrupt(exc: BaseException) -> bool:
    """Ctrl-C (``KeyboardInterrupt``) or another signal raised as a non-``Exception`` (Prefect's
    ``TerminationSignal`` while a flow holds SIGTERM); not ``SystemExit``, which is a program's own exit."""
    return not isinstance(exc, (Exception, SystemExit, GeneratorExit))


# Rust libraries (safetensors) report an OS error only inside their message: "... (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# torch.save to a path on a full disk: "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+")


def _os_errno(exc: BaseException) -> int | None:
    """The errno an exception carries: ``OSError.errno``, or the one a Rust library wrote in its message."""
    if isinstance(exc, OSError):
        return exc.errno
    found = _RUST_OS_ERROR.search(str(exc))
    return int(found.group(1)) if found else None


def exit_code_of(exc: BaseException) -> int:
    """The documented exit code for ``exc``: 2 input, 3 environment, 1 anything else (a bug)."""
    classified = classify(exc)
    return classified.exit_code if classified is not None else EXIT_BUG


def is_retryable(exc: BaseException) -> bool:
    """Whether running the same work again may succeed: input errors never, bugs and outages may."""
    classified = classify(exc)
    return True if classified is None else classified.retryable



@contextlib.contextmanager
def naming_the_place(what: str, place: str):
    """``with naming_the_place("writing cache", url):``: an environment failure inside (a full disk, a
    read-only folder) whose line does not name ``place`` gets ``what place:`` in front of it."""
    try:
        yield
    except Exception as err:
        found = classify(err)
        if isinstance(found, EnvironmentFailure) and place not in str(found):
            raise EnvironmentFailure(f"{what} {place}: {found}", retryable=found.retryable) from err
        raise
