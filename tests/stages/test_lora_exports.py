"""LoRA files during training (output.export_every) and byte-identical exports of identical runs."""

from __future__ import annotations

import hashlib

from safetensors.torch import load_file

from stages import preprocess, train
from tests.stages.metadata import keep_rows


def _lora_files(output):
    return {str(p.relative_to(output)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(output.rglob("*.safetensors")) if "checkpoints" not in p.parts}


def test_exports_follow_epochs_or_checkpoints_and_identical_runs_give_identical_bytes(make_config, tmp_path):
    steps = ["train.max_steps=6", "train.save_steps=4", "train.lora_alpha=8"]
    cfg = make_config(*steps)
    keep_rows(cfg, 4)  # 4 steps an epoch
    preprocess.run(cfg)
    train.run(cfg)
    again = make_config(*steps, f"output.path={tmp_path / 'again'}")
    train.run(again)

    first = _lora_files(cfg.output_dir)
    assert sorted(first) == ["lora.safetensors", "lora_comfyui.safetensors", "lora_diffsynth.safetensors",
                             "loras/epoch-0.safetensors", "loras/epoch-0_comfyui.safetensors",
                             "loras/epoch-0_diffsynth.safetensors"]
    assert first == _lora_files(again.output_dir)  # sha256 of every file

    at_4 = load_file(str(cfg.output_dir / "checkpoints" / "step-00000004" / "trainable.safetensors"))
    epoch_0 = load_file(str(cfg.output_dir / "loras" / "epoch-0.safetensors"))
    assert len(epoch_0) == len(at_4)
    for key, value in at_4.items():
        assert epoch_0["transformer." + key.replace(".default.", ".")].equal(value), key
    final = load_file(str(cfg.output_dir / "lora.safetensors"))
    assert any(not final[k].equal(v) for k, v in epoch_0.items())  # 2 more steps changed it

    saves = make_config(*steps, "output.export_every=save", "offload.enable_model_cpu_offload=true",
                        f"output.path={tmp_path / 'saves'}")  # exported while the offload engine is attached
    train.run(saves)
    files = _lora_files(saves.output_dir)
    assert sorted(f for f in files if f.startswith("loras/")) == [
        f"loras/step-{n}{s}.safetensors" for n in (4, 6) for s in ("", "_comfyui", "_diffsynth")]
    for suffix in ("", "_comfyui", "_diffsynth"):  # the last checkpoint's export is the final LoRA
        assert files[f"loras/step-6{suffix}.safetensors"] == files[f"lora{suffix}.safetensors"]

    end = make_config(*steps, "output.export_every=end", f"output.path={tmp_path / 'end'}")
    train.run(end)
    assert not (end.output_dir / "loras").exists()
