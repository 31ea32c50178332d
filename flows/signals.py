"""How a CLI verb takes Ctrl-C and SIGTERM: as ``KeyboardInterrupt``, remembered, absorbed once reported.

* Both raise ``KeyboardInterrupt`` in the main thread (SIGTERM like Ctrl-C: servers stopped, runs
  marked, work kept), and the CLI exits 130 in one line.
* Each one is remembered, because a library may catch the exception and raise its own without it:
  pydantic-settings, under ``prefect.settings.temporary_settings``, raised
  ``PydanticSerializationError: Error calling function `_ser_model`: KeyboardInterrupt: SIGTERM``
  with no cause attached, which the CLI reported as a bug (exit 1).
* One raised where Python cannot propagate it -- a ``__del__`` or a weakref callback the garbage
  collector ran just then ("Exception ignored in ...") -- is delivered again, or the verb would
  carry on as if no signal had come.
* From the first interrupt on, the verb exits within ``STOP_GRACE_S`` whatever holds it: a
  stop seen under load deadlocked in tqdm's lock, which a thread had left held (its worker thread
  and the CLI's own closing of the progress bars waited on it forever, and so did the
  interpreter's join of the task threads).  Exiting then is as safe as a SIGKILL: every write
  is atomic, and the next run resumes (README).
* Once the interrupt is being reported, later ones are absorbed.  A Prefect flow holds SIGTERM while
  it runs and re-sends the one it caught to the process (``capture_sigterm`` in
  ``prefect/utilities/engine/__init__.py``: ``os.kill(os.getpid(), exc.signal)``); the kernel may hand
  it to another thread, so it can land after the verb printed its line and killed the process
  through Python's unhandled-``KeyboardInterrupt`` exit (status -2 instead of 130).

:func:`deferred` is for a few lines that must not be cut (stopping the private server): a signal
arriving there is raised when they are done.  Masking the signal would not do: the kernel delivers
a process-directed signal to any thread that has it unmasked, and Python then runs the handler in
the main thread regardless.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from diffsynth_core.errors import EXIT_INTERRUPTED, is_interrupt

STOPPING = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE_S = 30.0  # crash reports, log flush (<= 5 s) and the server's stop (<= 10 s) fit well within


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # signal.signal works only there


def _interrupt_main_after(event: threading.Event, signum: int) -> None:
    event.wait()
    _thread.interrupt_main(signum)


def _absorbed(signum, frame) -> None:
    """The verb is already ending on an interrupt: a second one (or Prefect's re-sent one) changes nothing."""


class StopSignals:
    """Ctrl-C and SIGTERM for one verb: ``received`` holds those that arrived, in order.

    ``restore``: put the previous handlers back at the end and drop the deadline (``main`` called
    in-process, by tests or an embedding program); a process entry keeps both, so a re-sent signal
    after ``main`` returned is still absorbed, and a thread the interpreter cannot join at exit
    does not hold the process.
    """

    def __init__(self, verb: str, restore: bool):
        self.verb, self.restore = verb, restore
        self._deadline: threading.Timer | None = None
        self.received: list[signal.Signals] = []
        self._previous: dict[int, object] = {}
        self._previous_hook = sys.unraisablehook
        self._ending = False

    def __enter__(self) -> "StopSignals":
        if _in_main_thread():
            self._previous = {sig: signal.signal(sig, self._interrupt) for sig in STOPPING}
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def _interrupt(self, signum, frame) -> None:
        self.received.append(signal.Signals(signum))
        self._start_deadline()
        raise KeyboardInterrupt(self.received[-1].name)

    def _start_deadline(self) -> None:
        if self._deadline is None:
            self._deadline = threading.Timer(STOP_GRACE_S, self._exit_now)
            self._deadline.daemon = True
            self._deadline.start()

    def _exit_now(self) -> None:
        sys.stderr.write(f"splitflow {self.verb}: interrupted, and stopping took over {STOP_GRACE_S:.0f} s: exiting "
                         "now; work written so far is kept, re-run to resume\n")
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    def _unraisable(self, unraisable) -> None:
        stopped = unraisable.exc_value
        if self._ending or stopped is None or not is_interrupt(stopped):
            self._previous_hook(unraisable)
            return
        # Lost where it was raised: simulate the signal again in the main thread (Prefect's
        # TerminationSignal carries its own).  From another thread, once this hook returns: one
        # simulated while the hook runs would be raised inside it, and lost the same way.
        # Nothing to print: the interrupt is not lost.
        signum = getattr(stopped, "signal", None) or (self.received or [signal.SIGINT])[-1]
        hook_done = threading.Event()
        threading.Thread(target=_interrupt_main_after, args=(hook_done, signum), daemon=True).start()
        hook_done.set()

    def absorb(self) -> None:
        """From now on the verb reports its interrupt and ends: further stop signals are absorbed."""
        self._ending = True
        self._start_deadline()  # also for an interrupt that came as Prefect's TerminationSignal alone
        if self._previous:
            for sig in STOPPING:
                signal.signal(sig, _absorbed)

    def __exit__(self, *exc) -> None:
        if not self.restore:
            return
        if self._deadline is not None:  # in-process: the caller's process lives on
            self._deadline.cancel()
        if self._previous:
            _reinstall(self._previous)
            sys.unraisablehook = self._previous_hook


@contextmanager
def deferred() -> Iterator[None]:
    """Ctrl-C or SIGTERM arriving inside the block is raised after it, through the handler in place then."""
    if not _in_main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in STOPPING}
    try:
        yield
    finally:
        _reinstall(previous)
        for signum in dict.fromkeys(arrived):  # each signal once, in order of arrival
            signal.raise_signal(signum)


def _reinstall(handlers: dict[int, object]) -> None:
    for sig, handler in handlers.items():
        if handler is not None:  # None: installed outside Python, cannot be put back from here
            signal.signal(sig, handler)
