"""Run a ``splitflow`` verb in this process and check its failure is one line with the documented exit code."""

from __future__ import annotations

from flows.cli import main


def cli(capsys, *argv) -> tuple[int, str]:
    """Exit code and stderr of ``splitflow ARGV`` run in this process (stdout kept in ``capsys.out``)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    capsys.out = captured.out
    return code, captured.err


def assert_one_line(code: int, err: str, expected_code: int, *fragments: str) -> str:
    """The verb failed with ``expected_code`` and one ``splitflow VERB: error: ...`` line, last, holding
    ``fragments``."""
    assert "Traceback" not in err, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("splitflow ") and " error: " in line]
    assert len(errors) == 1 and lines[-1] == errors[0], lines[-5:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert code == expected_code, (code, errors[0])
    return errors[0]
