import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import VERBS, build_parser, main
from flows.runconfig import load_run_config, run_name
from flows.server import _profile_api_url

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


def test_pools_refuse_storage_options_overrides_and_need_a_shared_server(tmp_path):
    """Overrides become run parameters on pools (readable through the API): no credentials there;
    and a private server cannot serve workers: pools need PREFECT_API_URL."""
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlearning_rate = 0.1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_PROFILE")}
    env["HOME"] = str(tmp_path)  # no Prefect profile naming a server
    pools = ["--preprocess-pool", "cheap", "--train-pool", "big"]
    for extra, expected in ((["--set", 'cache.storage_options={key="x"}'], "cache.storage_options"),
                            ([], "PREFECT_API_URL")):
        run = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path), *pools, *extra], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and expected in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "splitflow-out").exists()  # the failed first run took its Prefect home away


def test_the_api_url_of_the_active_prefect_profile_is_used(tmp_path, monkeypatch):
    (tmp_path / "profiles.toml").write_text('active = "team"\n[profiles.team]\n'
                                            'PREFECT_API_URL = "http://prefect.team:4200/api"\n')
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.delenv("PREFECT_PROFILE", raising=False)
    monkeypatch.delenv("PREFECT_PROFILES_PATH", raising=False)
    assert _profile_api_url() == "http://prefect.team:4200/api"


def test_a_flow_loads_its_config_from_a_url(tmp_path):
    import fsspec

    with fsspec.open("memory://configs/run.toml", "w") as handle:
        handle.write("[train]\nlearning_rate = 0.25\n")
    cfg = load_run_config("memory://configs/run.toml", ["train.max_steps=3"])
    assert cfg.train.learning_rate == 0.25 and cfg.train.max_steps == 3
    assert run_name("memory://configs/run.toml") == "configs"
    assert run_name(str(tmp_path / "qwen lora.toml")) == "qwen-lora" and run_name(None, "x/y") == "x-y"


def _deploy_without_an_api(config: Path, *extra: str) -> subprocess.CompletedProcess:
    """``splitflow deploy`` with PREFECT_API_URL where nothing listens (the configs below set
    ``orchestration.api_grace_s`` = 600): a check made before the wait for the API answers at once."""
    from flows.server import _free_port

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_PROFILE")}
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{_free_port()}/api"
    return subprocess.run([sys.executable, "-m", "flows.cli", "deploy", str(config), "--preprocess-pool", "cheap",
                           "--train-pool", "big", *extra], env=env, cwd=config.parent, capture_output=True, text=True,
                          timeout=120)


def test_deploy_refuses_storage_options_overrides_before_waiting_for_the_api(tmp_path):
    """The check comes first: no wait of orchestration.api_grace_s for a server that is not there."""
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlearning_rate = 0.1\n\n[orchestration]\napi_grace_s = 600\n")
    run = _deploy_without_an_api(path, "--set", 'cache.storage_options={key="x"}')
    assert run.returncode == 2 and "cache.storage_options" in run.stderr, run.stderr


def test_deploy_names_bad_lora_targets_of_a_model_on_this_machine_before_waiting_for_the_api(tmp_path):
    """As a pooled ``splitflow run`` does: the LoRA targets are checked before anything is registered."""
    from diffsynth_core.models import get_family

    folder = get_family("qwen_image").save_tiny_model(tmp_path / "model", 0)
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nfamily = "qwen_image"\npath = "{folder}"\n\n[train]\nlora_rank = 4\n'
                      'lora_target_modules = ["to_q", "nonsense"]\n\n[orchestration]\napi_grace_s = 600\n')
    run = _deploy_without_an_api(config)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "['nonsense'] match no Linear module" in lines[0], run.stderr


def test_lora_targets_of_a_model_only_the_pools_hold_are_left_to_them(tmp_path):
    """Released files named in model.sources that are not on this machine: a local run says so at once; a
    pooled one (or a deployment) leaves them to the workers, whose load names what they lack."""
    from diffsynth_core.errors import InputError
    from diffsynth_core.models import get_family
    from stages.common import check_lora_targets
    from stages.config import load_config

    config = tmp_path / "run.toml"
    config.write_text('[model]\nfamily = "qwen_image"\n\n[model.sources]\ntransformer = ["/gpu-node/qwen/dit.safetensors"]'
                      '\n\n[train]\nlora_rank = 4\nlora_target_modules = ["nonsense"]\n')
    cfg, spec = load_config(config), get_family("qwen_image")
    check_lora_targets(cfg, spec, local=False)  # the pools' machines have the file: nothing to say here
    with pytest.raises(InputError, match="model.sources.transformer: /gpu-node/qwen/dit.safetensors does not exist"):
        check_lora_targets(cfg, spec, local=True)

