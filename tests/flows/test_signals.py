"""Ctrl-C and SIGTERM in the CLI: exit 130 in one line, however a library or Prefect passed the signal on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diffsynth_core.errors import InputError
from flows.cli import VERBS, main, report_failure
from flows.signals import StopSignals, deferred

REPO = Path(__file__).resolve().parents[2]
INTERRUPTED = "interrupted; work written so far is kept, re-run to resume"


def _with_verb(monkeypatch, verb) -> None:
    monkeypatch.setitem(VERBS, "status", (verb, VERBS["status"][1]))


def _serialised_while_interrupted() -> Exception:
    """What pydantic raises when Ctrl-C lands inside one of its serializer callbacks."""
    from pydantic import BaseModel, model_serializer

    class Payload(BaseModel):
        x: int

        @model_serializer(mode="wrap")
        def _ser_model(self, handler):
            raise KeyboardInterrupt("SIGTERM")

    try:
        Payload(x=1).model_dump()
    except Exception as wrapped:  # PydanticSerializationError, the interrupt as its __cause__
        return wrapped
    raise AssertionError("pydantic did not wrap the interrupt")


def test_an_interrupt_a_library_wrapped_exits_130_in_one_line(capsys):
    wrapped = _serialised_while_interrupted()
    assert not isinstance(wrapped, KeyboardInterrupt)
    assert report_failure("run", wrapped, debug=False) == 130
    assert capsys.readouterr().err.splitlines() == [f"splitflow run: {INTERRUPTED}"]


def test_a_sigterm_a_library_turned_into_its_own_error_exits_130(tmp_path, monkeypatch, capsys):
    """pydantic-settings under Prefect's temporary_settings kept only the interrupt's name, in its message."""
    def verb_whose_library_drops_the_interrupt(args, extra):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in this thread at once
        except KeyboardInterrupt as caught:
            message = f"Error calling function `_ser_model`: {type(caught).__name__}: {caught}"
        raise RuntimeError(message)  # a fresh error: neither cause nor context leads back to the signal

    _with_verb(monkeypatch, verb_whose_library_drops_the_interrupt)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert main(["status", str(tmp_path / "run.toml")]) == 130
    assert capsys.readouterr().err.splitlines() == [f"splitflow status: {INTERRUPTED}"]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # restored in-process


class _InterruptedWhileShown(InputError):
    """An input error whose message is being formatted when Ctrl-C (or SIGTERM) lands."""

    def __str__(self):
        raise KeyboardInterrupt("SIGTERM")


def test_an_interrupt_landing_while_a_failure_is_reported_still_exits_130(tmp_path, monkeypatch, capsys):
    def failing_verb(args, extra):
        raise _InterruptedWhileShown("sample 3: unreadable")

    _with_verb(monkeypatch, failing_verb)
    assert main(["status", str(tmp_path / "run.toml")]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == f"splitflow status: {INTERRUPTED}"


def test_prefects_termination_signal_reaching_the_cli_exits_130(tmp_path, monkeypatch, capsys):
    from prefect.exceptions import TerminationSignal  # a flow's SIGTERM, raised while Prefect holds the signal

    def verb_stopped_in_a_flow(args, extra):
        raise TerminationSignal(15)

    _with_verb(monkeypatch, verb_stopped_in_a_flow)
    assert main(["status", str(tmp_path / "run.toml")]) == 130
    assert capsys.readouterr().err.splitlines() == [f"splitflow status: {INTERRUPTED}"]


def test_the_sigterm_prefect_resends_after_the_line_does_not_kill_the_verb():
    """Prefect's capture_sigterm re-sends the SIGTERM it caught (os.kill); here it lands after main
    returned, while the process is still ending. Unabsorbed, it exited through Python's unhandled
    KeyboardInterrupt path: status -2 (killed by SIGINT) instead of 130 -- the CI failure seen."""
    script = textwrap.dedent("""
        import os, signal, sys, threading, time
        from flows import cli

        def verb_stopped_in_a_flow(args, extra):
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()  # the re-sent one, late
            raise KeyboardInterrupt("SIGTERM")

        cli.VERBS["status"] = (verb_stopped_in_a_flow, "")
        code = cli.main()
        time.sleep(1.0)  # still ending (logs flushed, threads joined) when the re-sent signal lands
        sys.exit(code)
    """)
    done = subprocess.run([sys.executable, "-c", script, "status", "run.toml"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.splitlines() == [f"splitflow status: {INTERRUPTED}"]


def test_a_signal_during_a_deferred_block_is_raised_after_it():
    finished = []
    with StopSignals("status", restore=True), pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with deferred():  # e.g. the private server being stopped: its pidfile must go too
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            finished.append("the block")
    assert finished == ["the block"]


class _SignalledWhileCollected:
    """An object whose finalizer is running when SIGTERM lands: Python can only print what it raises."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here, inside __del__: "Exception ignored in ..."


def test_a_signal_lost_in_a_finalizer_is_delivered_again(tmp_path, monkeypatch, capsys):
    steps = []

    def verb_collecting_garbage(args, extra):
        _SignalledWhileCollected()  # collected at once, its __del__ runs here
        for step in range(50):  # the rest of the work, which the signal must stop
            steps.append(step)
            time.sleep(0.1)
        return 0

    _with_verb(monkeypatch, verb_collecting_garbage)
    assert main(["status", str(tmp_path / "run.toml")]) == 130
    assert len(steps) < 5 and capsys.readouterr().err.splitlines() == [f"splitflow status: {INTERRUPTED}"]


def test_a_stop_that_deadlocks_still_ends_the_verb_within_the_grace():
    """Seen under load: a thread had left tqdm's lock held; after the SIGTERM the CLI's closing of the
    progress bars (and a task thread, and the interpreter's join of it) waited on it forever."""
    script = textwrap.dedent("""
        import os, signal, sys, threading, time
        from tqdm import tqdm
        from flows import cli, signals

        signals.STOP_GRACE_S = 1.0

        def verb_whose_library_lock_is_left_held(args, extra):
            bar = tqdm(total=10, desc="preprocess")
            leaver = threading.Thread(target=tqdm.get_lock().acquire)  # dies holding the lock
            leaver.start()
            leaver.join()
            waiter = threading.Thread(target=bar.update)  # a task thread, waiting on it: never joins
            waiter.start()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)

        cli.VERBS["status"] = (verb_whose_library_lock_is_left_held, "")
        sys.exit(cli.main())
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script, "status", "run.toml"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130 and time.monotonic() - started < 30, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].endswith(  # after the bar's own partial line
        "splitflow status: interrupted, and stopping took over 1 s: exiting now; work written so far is kept, "
        "re-run to resume")
