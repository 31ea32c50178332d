"""The error taxonomy: classes carry exit codes and retryability; library errors are classified."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from cache_store import CacheFormatError, IncompleteCacheError
from diffsynth_core.data.errors import DatasetError
from diffsynth_core.errors import (EXIT_BUG, EXIT_ENVIRONMENT, EXIT_INPUT, EXIT_INTERRUPTED, EnvironmentFailure,
                                   InputError, Interrupted, LockHeldError, classify, exit_code_of, is_retryable)
from stages.config import ConfigError


@pytest.mark.parametrize("error", [ConfigError("x"), DatasetError("x", row=3), CacheFormatError("x"),
                                   IncompleteCacheError("x")])
def test_input_errors_exit_2_and_are_never_retried(error):
    assert isinstance(error, InputError) and isinstance(error, ValueError)
    assert exit_code_of(error) == EXIT_INPUT
    assert not is_retryable(error)


def test_environment_failures_exit_3():
    assert exit_code_of(LockHeldError("held by pid 1")) == EXIT_ENVIRONMENT
    assert is_retryable(EnvironmentFailure("server down"))
    assert not is_retryable(EnvironmentFailure("x", retryable=False))


def test_disk_full_is_named_and_not_retried():
    full = OSError(errno.ENOSPC, "No space left on device", "/out/checkpoints/step-1/trainable.safetensors")
    wrapped = RuntimeError("unexpected pos 7936 vs 7824")
    wrapped.__cause__ = full  # libraries that wrap the OS error
    found = classify(wrapped)
    assert found is not None and found.exit_code == EXIT_ENVIRONMENT and not found.retryable
    assert "/out/checkpoints/step-1/trainable.safetensors" in str(found) and "disk is full" in str(found)


def test_network_errors_are_retryable_and_bugs_exit_1():
    assert is_retryable(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert exit_code_of(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) == EXIT_ENVIRONMENT
    assert classify(ZeroDivisionError()) is None and exit_code_of(KeyError("k")) == EXIT_BUG


def test_cli_prints_one_line_and_the_documented_code(tmp_path):
    run = subprocess.run([sys.executable, "-m", "flows.cli", "status", str(tmp_path / "missing.toml")],
                         capture_output=True, text=True)
    assert run.returncode == EXIT_INPUT
    assert run.stderr.strip().splitlines() == [f"splitflow status: error: config file not found: "
                                               f"{tmp_path / 'missing.toml'}"]
    debug = subprocess.run([sys.executable, "-m", "flows.cli", "--debug", "status", str(tmp_path / "missing.toml")],
                           capture_output=True, text=True)
    assert debug.returncode == EXIT_INPUT and "Traceback" in debug.stderr


@pytest.mark.parametrize("message", [
    "Error while serializing: I/O error: No space left on device (os error 28)",  # safetensors (Rust)
    "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534",  # torch.save to a path
])
def test_disk_full_reported_only_in_a_message_is_recognised(message):
    found = classify(RuntimeError(message))
    assert found is not None and found.exit_code == EXIT_ENVIRONMENT and not found.retryable
    assert "full" in str(found)


def _raised_while_handling(signal_exc: BaseException, error: Exception) -> Exception:
    """``error`` raised by code that was handling ``signal_exc``, as Python chains it (``__context__``)."""
    try:
        try:
            raise signal_exc
        except BaseException:
            raise error
    except Exception as chained:
        return chained


def test_an_interrupt_wins_over_what_broke_while_it_unwound():
    # A checkpoint write cut short by Ctrl-C may fail with a disk-looking error: still an interrupt.
    found = classify(_raised_while_handling(KeyboardInterrupt("SIGTERM"), InputError("sample 3: unreadable")))
    assert isinstance(found, Interrupted) and found.exit_code == EXIT_INTERRUPTED == 130
    assert not is_retryable(KeyboardInterrupt()) and "re-run to resume" in str(found)


def test_prefects_termination_signal_is_an_interrupt_and_system_exit_is_not():
    from prefect.exceptions import TerminationSignal  # what a flow raises for SIGTERM while it holds the signal

    assert exit_code_of(_raised_while_handling(TerminationSignal(15), RuntimeError("x"))) == EXIT_INTERRUPTED
    assert classify(_raised_while_handling(SystemExit(0), RuntimeError("x"))) is None


def test_a_full_disk_names_the_place_being_written():
    """/dev/full answers every write with ENOSPC and no file name, as a full disk under a library does."""
    import pytest

    from diffsynth_core.errors import EnvironmentFailure, naming_the_place

    with pytest.raises(EnvironmentFailure) as err:
        with naming_the_place("writing the final export in", "/runs/out"):
            with open("/dev/full", "wb", buffering=0) as handle:
                handle.write(b"x" * 64)
    assert str(err.value).startswith("writing the final export in /runs/out: ") and "disk is full" in str(err.value)
    assert err.value.retryable is False
