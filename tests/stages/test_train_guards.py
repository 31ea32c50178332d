"""On the real (tiny) Qwen-Image DiT: LoRA on the last block's text-stream layers can never learn
(the model discards that block's text output); training finds them, says so in one line, leaves
them out of the optimizer and records them, so a resume does the same."""

from __future__ import annotations

import logging

import torch
from safetensors.torch import load_file

from diffsynth_core.training.checkpoint import CheckpointManager
from stages import train
from stages.config import load_config

TARGETS = "train.lora_target_modules=['to_q', 'to_add_out', 'add_v_proj', 'txt_mlp.net.2', 'img_mlp.net.2']"
DEAD = ["transformer_blocks.1.attn.to_add_out", "transformer_blocks.1.txt_mlp.net.2"]  # tiny model: 2 blocks


def test_lora_layers_of_the_discarded_text_stream_are_found_reported_and_left_out(preprocessed_demo, tmp_path,
                                                                                  caplog):
    sets = [TARGETS, f"output.path={tmp_path / 'out'}", "train.save_steps=1"]
    with caplog.at_level(logging.WARNING):
        train.run(load_config(preprocessed_demo / "config.toml", [*sets, "train.max_steps=2"]))
    lines = [r.getMessage() for r in caplog.records if "get no gradient" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(": " + ", ".join(DEAD)), lines
    saved = CheckpointManager(tmp_path / "out" / "checkpoints").load()
    assert sorted(saved["metadata"]["no_gradient"]) == sorted(f"{m}.lora_{ab}.default.weight"
                                                              for m in DEAD for ab in "AB")
    caplog.clear()
    summary = train.run(load_config(preprocessed_demo / "config.toml", [*sets, "train.max_steps=3"]))
    assert summary.resumed_from == 2 and not [r for r in caplog.records if "get no gradient" in r.getMessage()]
    lora = load_file(str(tmp_path / "out" / "lora.safetensors"))
    dead_b = [k for k in lora if any(m in k for m in DEAD) and "lora_B" in k]
    live_b = [k for k in lora if "to_q" in k and "lora_B" in k]
    assert len(dead_b) == 2 and all(not lora[k].any() for k in dead_b)  # B starts at zero and never moved
    assert all(lora[k].any() for k in live_b)  # the others learned
    assert all(torch.isfinite(t).all() for t in lora.values())
