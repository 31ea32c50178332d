"""Per-step metrics to ``metrics.csv`` (and TensorBoard when asked), each step exactly once.

On resume the CSV is cut back to the resumed step, so steps that ran after the last
checkpoint of a killed run are not listed twice.
"""

from __future__ import annotations

import csv
from pathlib import Path

# samples: how many samples the step trained on (all ranks); bucket: their latent shape(s), e.g. 16x1x12x16
COLUMNS = ("step", "epoch", "loss", "lr", "step_time_s", "samples_per_s", "samples", "bucket")


class MetricsLog:
    def __init__(self, path: Path | str, resume_step: int = 0, tensorboard_dir: Path | str | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._writer = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._writer = SummaryWriter(str(tensorboard_dir), purge_step=resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        rows = []
        if self.path.is_file():
            with self.path.open(newline="") as handle:
                rows = [r for r in csv.DictReader(handle) if int(r["step"]) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(self.path)

    def log(self, **row) -> None:
        with self.path.open("a", newline="") as handle:
            csv.DictWriter(handle, fieldnames=COLUMNS).writerow({k: row[k] for k in COLUMNS})
        if self._writer is not None:
            for key in ("loss", "lr", "step_time_s", "samples_per_s"):
                self._writer.add_scalar(f"train/{key}", row[key], row["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: Path | str) -> list[dict[str, str]]:
    with Path(path).open(newline="") as handle:
        return list(csv.DictReader(handle))
