"""The edit demo (``splitflow demo --variant``) through both stages on the CPU: its loss falls."""

from __future__ import annotations

import csv

from stages import preprocess, train
from stages.demo_edit import prepare_edit_demo


def test_edit_demo_trains_and_its_loss_falls(tmp_path):
    # no validation images: the loss is what this test reads (the demo itself renders them)
    cfg, _ = prepare_edit_demo(tmp_path / "demo", "edit-2509", ["preprocess.parts=1", "train.max_steps=48",
                                                              "train.validation_prompts=[]"])
    preprocess.run(cfg)
    train.run(cfg)
    rows = list(csv.DictReader((cfg.output_dir / "metrics.csv").open()))
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) == 48
    first, last = sum(losses[:12]) / 12, sum(losses[-12:]) / 12  # a quarter each: sigmas vary
    assert last < first, losses
    assert (cfg.output_dir / "lora.safetensors").is_file()
