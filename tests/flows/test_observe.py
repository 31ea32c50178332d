"""The CLI's console set-up, repeated in one process (tests, the demo): one echo filter per handler."""

import logging

from flows.observe import _FailureEchoFilter, console, failure_kind


def _echo_filters() -> list[int]:
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = [h for logger in (logging.getLogger(), logging.getLogger("prefect")) for h in logger.handlers
                if isinstance(h, PrefectConsoleHandler)]
    return [sum(isinstance(f, _FailureEchoFilter) for f in h.filters) for h in handlers]


def test_each_session_leaves_one_echo_filter_and_debug_none():
    from prefect.logging.configuration import setup_logging

    setup_logging(incremental=False)  # Prefect's handlers as a fresh process has them (other tests strip them)
    console(private_server=True)
    console(private_server=False, api_url="http://127.0.0.1:4200/api")
    counts = _echo_filters()
    assert counts and set(counts) == {1}
    console(debug=True)
    assert set(_echo_filters()) == {0}


def test_a_worker_stopped_mid_stage_is_re_submitted_not_ended():
    """A SIGTERM on a pool worker (spot preemption, worker shut down) that a library wrapped reaches the
    stage flow as an ordinary error: the coordinator must run the part again elsewhere."""
    from prefect.exceptions import TerminationSignal

    try:
        try:
            raise TerminationSignal(15)
        except BaseException:
            raise RuntimeError("Error calling function `_ser_model`")
    except RuntimeError as wrapped:
        kind, line = failure_kind(wrapped)
    assert kind == "retryable" and "interrupted" in line
