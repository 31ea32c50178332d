"""Prefect artifacts of a run: a table per preprocess part, and training's summary, loss curve and images.

Everything shown is read from what the stages wrote (their summaries, ``metrics.csv``, the
validation images); nothing from ``cache.storage_options`` ever goes in.  Images travel as
small PNG data URLs, so they show in the UI without a file server.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

from PIL import Image, ImageDraw

from stages.config import RunConfig
from stages.preprocess import CacheSummary
from stages.status import metric_rows
from stages.train import TrainSummary

from .observe import artifact_key

THUMBNAIL = 256


def part_table(name: str, summary: CacheSummary) -> None:
    """Encoded / reused / skipped (with the row, file and reason of each skipped row) / prompts truncated."""
    from prefect.artifacts import create_table_artifact

    scope = "all" if summary.part is None else f"part-{summary.part + 1}-of-{summary.parts}"
    rows = [{"outcome": "encoded", "rows": summary.encoded, "row": "", "file": "", "reason": ""},
            {"outcome": "reused", "rows": summary.reused, "row": "", "file": "", "reason": ""}]
    rows += [{"outcome": "skipped", "rows": 1, "row": item.get("row"), "file": str(item.get("file") or ""),
              "reason": str(item.get("reason") or "")} for item in summary.skipped]
    if summary.truncated:  # prompts encoded now that the text encoder cut (a coordinator sums them too)
        rows.append({"outcome": "truncated", "rows": summary.truncated, "row": "", "file": "", "reason": ""})
    create_table_artifact(rows, key=artifact_key(name, "preprocess", scope),
                          description=f"{name}: {summary.describe()}")


def _png_data_url(image: Image.Image, max_side: int | None = THUMBNAIL) -> str:
    image = image.convert("RGB")
    if max_side:
        image.thumbnail((max_side, max_side))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def loss_curve(points: list[tuple[int, float]], size: tuple[int, int] = (480, 240)) -> Image.Image:
    """The loss per step as a line on a white canvas (PIL only: no plotting dependency)."""
    width, height = size
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    margin = 28
    draw.rectangle((margin, 8, width - 8, height - margin), outline=(160, 160, 160))
    if len(points) >= 2:
        steps, losses = zip(*points)
        low, high = min(losses), max(losses)
        span_x, span_y = max(steps[-1] - steps[0], 1), (high - low) or 1.0
        xy = [(margin + (s - steps[0]) / span_x * (width - 8 - margin),
               height - margin - (v - low) / span_y * (height - margin - 8)) for s, v in points]
        draw.line(xy, fill=(40, 90, 200), width=2)
        draw.text((margin + 4, 10), f"loss {high:.4g}", fill="black")
        draw.text((margin + 4, height - margin - 14), f"{low:.4g}", fill="black")
        draw.text((width - 90, height - margin + 6), f"step {steps[-1]}", fill="black")
    return image


def _latest_validation_images(cfg: RunConfig) -> list[Path]:
    images = sorted((cfg.output_dir / "validation").glob("step-*.png"))
    if not images:
        return []
    last_step = images[-1].name.rsplit("-", 1)[0]
    return [path for path in images if path.name.startswith(last_step + "-")]


def train_report(name: str, cfg: RunConfig, summary: TrainSummary) -> None:
    """A markdown summary (steps, final loss, time, output paths), the loss curve, validation images."""
    from prefect.artifacts import create_image_artifact, create_markdown_artifact

    rows = metric_rows(cfg)  # read once: the fallback final loss and the curve
    loss = summary.final_loss if summary.final_loss is not None else (float(rows[-1]["loss"]) if rows else None)
    lines = [f"# {name}: training", "", "| | |", "|---|---|", f"| steps | {summary.steps} |",
             f"| resumed from step | {summary.resumed_from} |",
             f"| final loss | {loss:.6g} |" if loss is not None else "| final loss | - |",
             f"| time | {summary.seconds:.1f} s |", f"| output | `{summary.output}` |"]
    lines += [f"| {kind} | `{path}` |" for kind, path in summary.exports.items()]
    lines += ["", f"Loss per step: `{cfg.output_dir / 'metrics.csv'}`; checkpoints: "
                  f"`{cfg.output_dir / 'checkpoints'}`."]
    create_markdown_artifact("\n".join(lines), key=artifact_key(name, "train-summary"),
                             description=f"{name}: {summary.describe()}")
    points = [(int(row["step"]), float(row["loss"])) for row in rows]
    if points:
        create_image_artifact(_png_data_url(loss_curve(points), max_side=None), key=artifact_key(name, "loss-curve"),
                              description=f"{name}: loss over {len(points)} steps")
    for index, path in enumerate(_latest_validation_images(cfg)):
        with Image.open(path) as image:
            url = _png_data_url(image)
        create_image_artifact(url, key=artifact_key(name, "validation", index),
                              description=f"{name}: {path.name}")
