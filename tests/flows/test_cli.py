import subprocess
import sys

import pytest

from flows.cli import VERBS, build_parser, main

DOCUMENTED_VERBS = {"demo", "run", "preprocess", "train", "resume", "status", "deploy", "cache"}


def test_verbs_match_the_documented_contract():
    assert set(VERBS) == DOCUMENTED_VERBS


@pytest.mark.parametrize("verb", sorted(DOCUMENTED_VERBS))
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([verb, "--help"])
    assert exit_info.value.code == 0
    assert VERBS[verb][1] in capsys.readouterr().out


def test_bad_config_key_exits_nonzero_with_the_key_named(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlearning_rate = 0.1\n")
    assert main(["status", str(path), "--set", "train.nope=1"]) == 2
    err = capsys.readouterr().err
    assert "train.nope" in err and "unknown key" in err


def test_console_script_entry_point_prints_help():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], capture_output=True, text=True, check=True)
    assert "splitflow demo" in out.stdout
