"""Validation of the dataset's decode settings: every problem found, named, before any work."""

from __future__ import annotations

from typing import Any, Sequence

from .media import usable_frame_count


def settings_errors(*, height: Any, width: Any, max_pixels: Any, num_frames: Any,
                    frame_multiple: Any, division: Any, repeat: Any,
                    data_file_keys: Sequence[str]) -> list[str]:
    """Return one message per invalid setting (empty when all are valid)."""
    errors: list[str] = []
    ok = {name: _positive_int(name, value, errors) for name, value in (
        ("division", division), ("max_pixels", max_pixels), ("repeat", repeat),
        ("num_frames", num_frames), ("frame_multiple", frame_multiple))}
    if (height is None) != (width is None):
        errors.append(f"give both height and width or neither, got height={height!r} width={width!r}")
    for name, value in (("height", height), ("width", width)):
        if value is not None and _positive_int(name, value, errors) and ok["division"] \
                and value % division:
            errors.append(f"{name}={value} must be a multiple of {division} (the latent grid); "
                          f"try {max(division, value // division * division)}")
    if ok["max_pixels"] and ok["division"] and max_pixels < division ** 2:
        errors.append(f"max_pixels={max_pixels} is below division**2={division ** 2}")
    if ok["num_frames"] and ok["frame_multiple"] and frame_multiple > 1 \
            and num_frames % frame_multiple != 1:
        errors.append(f"num_frames={num_frames} must be ≡ 1 (mod frame_multiple={frame_multiple}), "
                      f"e.g. {usable_frame_count(num_frames, frame_multiple)}")
    if not data_file_keys:
        errors.append("data_file_keys is empty")
    return errors


def _positive_int(name: str, value: Any, errors: list[str]) -> bool:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        errors.append(f"{name} must be a positive integer, got {value!r}")
        return False
    return True
