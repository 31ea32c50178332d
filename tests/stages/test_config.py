import pytest

from diffsynth_core.errors import InputError
from stages.compat.diffsynth import flag_overrides
from stages.config import ConfigError, RunConfig, build_config, load_config


def test_toml_round_trip_with_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nlearning_rate = 0.001\n[model]\nfamily = "flux"\n')
    cfg = load_config(path, ["train.max_steps=50", "train.lora_target_modules=to_q,to_k", "output.path=out"])
    assert cfg.train.learning_rate == 0.001 and cfg.train.max_steps == 50
    assert cfg.train.lora_target_modules == ["to_q", "to_k"] and cfg.model.family == "flux"
    saved = cfg.save(tmp_path / "config.toml")
    assert load_config(saved) == cfg


def test_yaml_config_loads(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("dataset:\n  repeat: 3\n")
    assert load_config(path).dataset.repeat == 3


def test_unknown_key_is_an_error_naming_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlearning_rat = 0.1\n")
    with pytest.raises(ConfigError, match="train.learning_rat"):
        load_config(path)
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        build_config({}, ["train.bogus=1"])
    with pytest.raises(ConfigError, match="section"):
        build_config({}, ["nosection.key=1"])


def test_every_bad_value_is_reported_with_its_dotted_key():
    with pytest.raises(ConfigError) as err:
        build_config({"train": {"learning_rate": -1, "save_steps": -2}, "dataset": {"height": 100}})
    text = str(err.value)
    assert "train.learning_rate" in text and "train.save_steps" in text and "multiple of 16" in text


def test_a_caption_extension_without_its_dot_is_a_one_line_error():
    # Path.with_suffix("txt") raised ValueError with a traceback when the folder was read.
    for dataset, key in [({"caption_extension": "txt"}, "dataset.caption_extension"),
                         ({"sources": [{"metadata_path": "imgs", "caption_extension": "caption"}]},
                          "dataset.sources.0.caption_extension")]:
        with pytest.raises(InputError) as err:
            build_config({"dataset": dataset})
        text = str(err.value)
        assert key in text and '".txt"' in text and "\n" not in text
    with pytest.raises(ConfigError, match="caption_extension"):
        build_config({"dataset": {"caption_extension": "."}})
    assert build_config({"dataset": {"caption_extension": ".caption"}}).dataset.caption_extension == ".caption"


def test_diffsynth_flags_map_to_config_keys():
    overrides = flag_overrides(
        ["--dataset_base_path", "data", "--use_gradient_checkpointing", "--lora_rank=32",
         "--lora_target_modules", "to_q,to_k,to_v", "--enable_model_cpu_offload"])
    cfg = build_config({}, overrides)
    assert cfg.dataset.base_path == "data" and cfg.train.gradient_checkpointing is True
    assert cfg.train.lora_rank == 32 and cfg.train.lora_target_modules == ["to_q", "to_k", "to_v"]
    assert cfg.offload.enable_model_cpu_offload is True
    with pytest.raises(ConfigError, match="--not_a_flag"):
        flag_overrides(["--not_a_flag", "1"])


def test_cache_url_defaults_under_the_output_dir():
    cfg = RunConfig.model_validate({"output": {"path": "/x/out"}, "cache": {"backend": "pth"}})
    assert cfg.cache_url == "/x/out/cache.pth"
