"""Loading a DiT from one ``.safetensors`` file (ComfyUI / original / diffusers key names).

Why not diffusers' ``from_single_file``: offline it needs ``config=``, its Qwen-Image mapping is
identity (a ComfyUI ``model.diffusion_model.`` prefix leaves every weight unused), and it
takes a prefixed diffusers-keyed file for an original one.  Here the prefix is stripped
first, the family's converter runs only when the keys are not already diffusers names, and
the model is built on the meta device and given the (mmapped) tensors with
``load_state_dict(assign=True)``: no random init, no 2x RAM peak.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..errors import InputError, classify
from .loading import MODEL_INIT_LOCK, check_materialised

# Prefixes ComfyUI and original checkpoints put in front of the DiT's own key names.
CHECKPOINT_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

StateDict = dict[str, torch.Tensor]


def strip_prefixes(state_dict: StateDict) -> StateDict:
    """Drop a leading ``model.diffusion_model.`` / ``diffusion_model.`` from every key that has one."""
    out: StateDict = {}
    for key, value in state_dict.items():
        for prefix in CHECKPOINT_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        out[key] = value
    return out


def transformer_config_dir(config_dir: Path) -> Path:
    """Accept either a model folder (``<dir>/transformer/config.json``) or the transformer folder itself."""
    config_dir = Path(config_dir)
    for candidate in (config_dir / "transformer", config_dir):
        if (candidate / "config.json").is_file():
            return candidate
    raise InputError(f"no transformer config.json in {config_dir} or {config_dir / 'transformer'}: model.path must "
                     f"hold the transformer's config beside model.transformer_file")


def _target_dtype(name: str, dtype: torch.dtype, keep_fp32: tuple[str, ...]) -> torch.dtype:
    # Same rule as diffusers' from_pretrained for _keep_in_fp32_modules.
    return torch.float32 if any(m in name.split(".") for m in keep_fp32) else dtype


def load_transformer_file(model_cls: type, file: Path, config_dir: Path, dtype: torch.dtype,
                          convert: Callable[[StateDict], StateDict] | None = None) -> torch.nn.Module:
    """Build ``model_cls`` from ``config_dir``'s config and the weights in ``file``.

    ``convert`` maps original (non-diffusers) key names to diffusers names; it runs only when
    the stripped keys do not already match the model's state dict.
    """
    from accelerate import init_empty_weights

    file = Path(file)
    if not file.is_file():
        raise InputError(f"model.transformer_file {file} not found (or not a file)")
    config = model_cls.load_config(transformer_config_dir(config_dir))
    with MODEL_INIT_LOCK, init_empty_weights():  # parameters on meta; buffers (RoPE tables) computed for real
        model = model_cls.from_config(config)
    expected = set(model.state_dict())
    state_dict = strip_prefixes(_read_weights(file))
    if convert is not None and not set(state_dict) <= expected:
        try:
            state_dict = convert(state_dict)
        except (KeyError, IndexError, ValueError, RuntimeError) as exc:
            raise InputError(f"{file}: keys are neither this transformer's diffusers names nor the original "
                             f"checkpoint names its converter knows ({type(exc).__name__}: {exc})") from exc
    _check_keys(file, expected, set(state_dict))
    keep_fp32 = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    state_dict = {k: v.to(_target_dtype(k, dtype, keep_fp32)) for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=True, assign=True)
    check_materialised(model, file)
    return model.eval()


def _read_weights(file: Path) -> StateDict:
    """All tensors of ``file`` (mmapped); a truncated or foreign file names itself (SafetensorError does not)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as err:  # noqa: BLE001 -- safetensors raises its own error type for bad files
        if classify(err) is not None or type(err).__name__ != "SafetensorError":
            raise
        raise InputError(f"{file}: not a readable .safetensors file ({err}): it is incomplete or corrupt; "
                         f"copy it again") from err


def _check_keys(file: Path, expected: set[str], found: set[str]) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise InputError(
            f"{file}: weights do not match the transformer config: {len(missing)} missing "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
