"""Wan2.2 A14B through the stages: both experts in one run, one expert per run, their files in each
consumer, a SIGKILLed run resumed bit for bit, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family
from diffsynth_core.models.wan import native_name
from flows.cli import main
from stages import preprocess, train
from stages.demo import demo_config
from stages.demo_video import write_demo_video_dataset

from .sigkill import train_until_first_checkpoint

STEPS = ["train.max_steps=4", "train.save_steps=2", "dataset.num_frames=5", "preprocess.parts=1"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny two-expert Wan2.2 folder over a drawn 5-frame video dataset, preprocessed once."""
    root = tmp_path_factory.mktemp("a14b")
    write_demo_video_dataset(root / "dataset")
    get_family("wan", "t2v-a14b").save_tiny_model(root / "model", 0)
    preprocess.run(demo_config(root, "wan", STEPS))
    return root


def _config(work, tmp_path, *extra):
    return demo_config(work, "wan", STEPS + [f"output.path={tmp_path / 'output'}", *extra])


def _checkpoint_weights(output):
    latest = (output / "checkpoints" / "latest").read_text().strip()
    return load_file(str(output / "checkpoints" / latest / "trainable.safetensors"))


def test_both_experts_train_in_one_run_and_each_file_loads_into_its_expert(work, tmp_path):
    from diffusers import WanPipeline
    from peft.utils import get_peft_model_state_dict

    summary = train.run(_config(work, tmp_path))
    output = tmp_path / "output"
    assert {k for k in summary.exports if k.startswith("diffusers")} == {"diffusers_high_noise", "diffusers_low_noise"}
    trained = _checkpoint_weights(output)
    pipe = WanPipeline.from_pretrained(work / "model")
    pipe.load_lora_weights(output, weight_name="lora_high_noise.safetensors", adapter_name="high")
    pipe.load_lora_weights(output, weight_name="lora_low_noise.safetensors", adapter_name="low",
                           load_into_transformer_2=True)
    for component, adapter in (("transformer", "high"), ("transformer_2", "low")):
        loaded = get_peft_model_state_dict(getattr(pipe, component), adapter_name=adapter)
        assert loaded, component
        for key, value in loaded.items():  # every weight loaded is the trained one of that expert
            assert torch.equal(value, trained[f"{component}.{key.replace('.weight', '.default.weight')}"]), key
    high, low = (load_file(str(output / f"lora_{label}.safetensors")) for label in ("high_noise", "low_noise"))
    assert high.keys() == low.keys() and any(not torch.equal(high[k], low[k]) for k in high)
    # ComfyUI and DiffSynth: each expert's file in Wan's native names, as for one Wan2.1 DiT
    for label, component in (("high_noise", "transformer"), ("low_noise", "transformer_2")):
        comfy = load_file(str(output / f"lora_{label}_comfyui.safetensors"))
        module = "blocks.0.attn1.to_q"
        assert torch.equal(comfy[f"diffusion_model.{native_name(module)}.lora_A.weight"],
                           trained[f"{component}.{module}.lora_A.default.weight"])
        diffsynth = load_file(str(output / f"lora_{label}_diffsynth.safetensors"))
        assert f"{native_name(module)}.lora_B.weight" in diffsynth
        with safe_open(str(output / f"lora_{label}.safetensors"), "pt") as handle:
            assert handle.metadata()["splitflow_expert"] == component


def test_one_expert_per_run_draws_its_sigmas_and_refuses_the_other_experts_lora(work, tmp_path):
    summary = train.run(_config(work, tmp_path / "low", "train.experts=['transformer_2']"))
    low_file = tmp_path / "low" / "output" / "lora_low_noise.safetensors"
    assert summary.exports["diffusers"] == str(low_file)
    assert not (tmp_path / "low" / "output" / "lora_high_noise.safetensors").exists()
    with safe_open(str(low_file), "pt") as handle:
        assert json.loads(handle.metadata()["splitflow_sigma_range"]) == [0.0, 0.875]
    assert all(k.startswith("blocks.") for k in _checkpoint_weights(tmp_path / "low" / "output"))
    # the low-noise LoRA continued for the high-noise expert: refused before any work, exit 2
    cfg = _config(work, tmp_path / "high", "train.experts=['transformer']", f"train.lora_checkpoint={low_file}")
    with pytest.raises(InputError, match="LoRA of expert 'transformer_2', but this run trains 'transformer'"):
        train.run(cfg)
    assert not (tmp_path / "high" / "output" / "checkpoints").exists()


def test_a_sigkilled_two_expert_run_resumes_to_the_same_loras_bit_for_bit(work, tmp_path):
    steps = ["train.max_steps=8", "train.save_steps=2"]
    reference = _config(work, tmp_path / "reference", *steps)
    train.run(reference)
    overrides = ["model.family=wan", *STEPS, *steps, f"output.path={tmp_path / 'killed' / 'output'}",
                 f"dataset.base_path={work / 'dataset'}", f"dataset.metadata_path={work / 'dataset' / 'metadata.csv'}",
                 f"model.path={work / 'model'}", f"cache.url={work / 'cache.zarr'}"]
    killed_at = train_until_first_checkpoint(work, overrides, tmp_path / "killed" / "output")
    assert 2 <= killed_at < 8, killed_at
    summary = train.run(_config(work, tmp_path / "killed", *steps))
    assert summary.resumed_from == killed_at
    for label in ("high_noise", "low_noise"):
        got = load_file(str(tmp_path / "killed" / "output" / f"lora_{label}.safetensors"))
        expected = load_file(str(tmp_path / "reference" / "output" / f"lora_{label}.safetensors"))
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), label


def test_a_boundary_outside_0_1_is_one_line_with_exit_2(work, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(work / "model", model)
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 1.5}))
    cfg = _config(work, tmp_path, f"model.path={model}")
    cfg.save(tmp_path / "config.toml")
    logging.getLogger().handlers = [h for h in logging.getLogger().handlers if "prefect" not in type(h).__module__]
    code = main(["train", str(tmp_path / "config.toml"), "--in-process"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "boundary_ratio = 1.5 must lie strictly between 0 and 1" in err and str(model) in err


@pytest.mark.parametrize("name, variant", [("wan22", "t2v-a14b"), ("wan22-ti2v", "ti2v-5b")])
def test_the_wan22_demos_build_their_tiny_model_and_video_dataset(name, variant, tmp_path):
    from stages.common import family_of
    from stages.demo import prepare_demo

    cfg, path = prepare_demo(tmp_path, name)
    assert path.is_file() and cfg.model.family == "wan" and cfg.dataset.num_frames == 5
    assert family_of(cfg).variant == variant
    assert (tmp_path / "dataset" / "metadata.csv").read_text().startswith("video,prompt")


@pytest.mark.parametrize("extra, message", [
    (["train.lora_rank=0", "train.trainable_models=['transformer']"], "full fine-tuning) is not available when a run "
                                                                       "trains two experts"),
    (["train.validation_prompts=['a red circle']", "train.validation_steps=2"], "not rendered for expert runs"),
    (["train.experts=['transformer_3']"], "name no expert of wan t2v-a14b"),
])
def test_what_expert_runs_lack_is_refused_before_any_work(work, tmp_path, extra, message):
    with pytest.raises(InputError, match=message.replace("(", "\\(").replace(")", "\\)")):
        train.run(_config(work, tmp_path, *extra))
    assert not (tmp_path / "output" / "checkpoints").exists()
