"""Loading components from files as they were released (and as DiffSynth-Studio downloads them).

A component's files are either a release's diffusers/transformers weights (a subfolder such as
``Qwen-Image/transformer/``, often without its ``config.json``: DiffSynth downloads only the
files its patterns name) or a release's own files with original key names (BFL's
``flux1-dev.safetensors`` and ``ae.safetensors``, Wan's ``.safetensors``/``.pth``).

Each family lists the formats it knows (``FamilySpec.released_formats``): how its keys look,
which diffusers/transformers class holds them, how to derive that class's config from the
weights' shapes (plus the family's fixed facts), and for original names a converter.  The same
entry recognises a file (family and component from its keys, never its name) and loads it:

* a ``config.json`` among the files is used as is; otherwise the config is inferred;
* transformers models load through ``from_pretrained`` (which knows its checkpoints' renames and
  tied weights) over a folder of links; diffusers models (original names converted first) are
  assigned to a model built on the meta device.  Either way tensors stay memory-mapped (no 2x RAM)
  and every weight must be present: a missing or misshapen one is an error naming the files.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import InputError, classify
from .loading import MODEL_INIT_LOCK, check_materialised
from .single_file import _target_dtype, strip_prefixes
from .weight_files import Shapes, StateDict, is_weight_file, load_files, read_shapes

_LIBRARIES = ("diffusers", "transformers")
_SINGLE_FILE, _SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"  # what transformers looks for


@dataclass(frozen=True)
class ReleasedFormat:
    """One way a family's component is stored in released files."""

    component: str                                    # "transformer", "vae", "text_encoder", ...
    library: str                                      # "diffusers" | "transformers"
    class_name: str                                   # e.g. "FluxTransformer2DModel"
    description: str                                  # what the files are, for messages
    recognise: Callable[[Shapes], bool]               # True when these (prefix-stripped) keys are this format
    infer_config: Callable[[Shapes], dict[str, Any]]  # the class's config from the weights' shapes
    convert: Callable[[StateDict], StateDict] | None = None  # original names -> the class's names


def count_indices(shapes: Mapping[str, Any], prefix: str) -> int:
    """How many ``<prefix><i>.`` blocks the keys hold (``blocks.0.``, ``blocks.1.`` ... -> 2)."""
    found = {int(k[len(prefix):].split(".", 1)[0]) for k in shapes
             if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0].isdigit()}
    return max(found) + 1 if found else 0


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE split (frame, height, width) of FLUX.1 and Qwen-Image: (16, 56, 56) at head_dim 128,
    the same proportions at other widths (tiny test models)."""
    frame = head_dim // 8
    return frame, (head_dim - frame) // 2, (head_dim - frame) // 2


def weight_and_config_files(files: Sequence[Path]) -> tuple[list[Path], Path | None]:
    weights = sorted(Path(f) for f in files if is_weight_file(Path(f)))
    configs = [Path(f) for f in files if Path(f).name == "config.json"]
    return weights, (configs[0] if configs else None)


def recognise(formats_by_family: Mapping[str, Sequence[ReleasedFormat]],
              files: Sequence[Path]) -> list[tuple[str, ReleasedFormat]]:
    """Every (family, format) whose keys match these files (several when a layout is shared)."""
    weights, _ = weight_and_config_files(files)
    if not weights:
        return []
    shapes = read_shapes(weights)
    return [(family, fmt) for family, formats in formats_by_family.items() for fmt in formats
            if fmt.recognise(shapes)]


def _library_class(library: str, class_name: str) -> type:
    import importlib

    if library not in _LIBRARIES:
        raise ValueError(f"library {library!r} is not one of {_LIBRARIES}")
    return getattr(importlib.import_module(library), class_name)


def _config_of(fmt: ReleasedFormat, weights: list[Path], config_file: Path | None,
               shapes: Shapes | None = None) -> dict[str, Any]:
    """The class's config: a ``config.json`` beside its own weights, else inferred from ``shapes``
    (the weights' shapes, read here when not given)."""
    if config_file is not None and fmt.convert is None:  # a config beside the class's own weights
        return json.loads(config_file.read_text())
    try:
        return fmt.infer_config(read_shapes(weights) if shapes is None else shapes)
    except (KeyError, IndexError, ValueError, ZeroDivisionError) as exc:
        where = weights[0] if len(weights) == 1 else weights[0].parent  # the file, or the shards' folder
        raise InputError(f"{where}: cannot derive the {fmt.class_name} config from the weights "
                         f"({type(exc).__name__}: {exc}); are these {fmt.description}?") from exc


def _linked_folder(fmt: ReleasedFormat, weights: list[Path], config: dict, folder: Path) -> Path:
    """A folder ``from_pretrained`` reads: the config plus links to the weights (and a shard index)."""
    single, index = _SINGLE_FILE, _SHARD_INDEX
    (folder / "config.json").write_text(json.dumps(config))
    if len(weights) == 1:
        os.symlink(weights[0].resolve(), folder / single)
        return folder
    weight_map = {}
    for n, path in enumerate(weights):
        name = f"part-{n:05d}.safetensors"
        os.symlink(path.resolve(), folder / name)
        weight_map.update({key: name for key in read_shapes([path], strip=False)})
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _from_pretrained(fmt: ReleasedFormat, weights: list[Path], config: dict, dtype: torch.dtype) -> torch.nn.Module:
    cls = _library_class(fmt.library, fmt.class_name)
    if any(p.suffix != ".safetensors" for p in weights):
        raise InputError(f"{weights[0].parent}: {fmt.description} must be .safetensors files")
    with tempfile.TemporaryDirectory(prefix="splitflow-links-") as tmp:
        folder = _linked_folder(fmt, weights, config, Path(tmp))
        with MODEL_INIT_LOCK:
            model, info = cls.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    bad = list(info.get("missing_keys", ())) + [str(m) for m in info.get("mismatched_keys", ())]
    if bad:  # transformers would leave them randomly initialised
        raise InputError(f"{weights[0].parent}: {len(bad)} weight(s) of {fmt.class_name} are missing or misshapen "
                         f"in the files (e.g. {bad[:3]}); are these {fmt.description}?")
    return model


def _fp32_modules(model: torch.nn.Module, library: str, dtype: torch.dtype) -> tuple[str, ...]:
    """Modules ``from_pretrained`` keeps in fp32: diffusers always; transformers only its "strict" ones,
    the others when loading in fp16 (transformers' modeling_utils, dtype plan)."""
    if library == "diffusers":
        return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return tuple(keep)


def _on_meta(fmt: ReleasedFormat, config: dict) -> torch.nn.Module:
    """``fmt``'s class built from ``config``: parameters on meta, computed buffers real."""
    from accelerate import init_empty_weights

    cls = _library_class(fmt.library, fmt.class_name)
    with MODEL_INIT_LOCK, init_empty_weights():
        return cls.from_config(config) if fmt.library == "diffusers" else cls(cls.config_class(**config))


def _from_converted(fmt: ReleasedFormat, weights: list[Path], config: dict, dtype: torch.dtype) -> torch.nn.Module:
    model = _on_meta(fmt, config)
    state = strip_prefixes(load_files(weights))
    state = fmt.convert(state) if fmt.convert is not None else state
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    if expected != found:
        missing = sorted(set(expected) - set(found))
        wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
        extra = sorted(set(found) - set(expected))
        raise InputError(f"{weights[0]}: the weights do not fit {fmt.class_name} ({len(missing)} missing e.g. "
                         f"{missing[:2]}, {len(wrong)} misshapen e.g. {wrong[:2]}, {len(extra)} unexpected e.g. "
                         f"{extra[:2]}); are these {fmt.description}?")
    state = {k: v.to(_target_dtype(k, dtype, _fp32_modules(model, fmt.library, dtype))) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


def load_component(fmt: ReleasedFormat, files: Sequence[Path], dtype: torch.dtype,
                   device: str | torch.device = "cpu", shapes: Shapes | None = None) -> torch.nn.Module:
    """Build ``fmt``'s class from ``files`` (weights, and maybe a ``config.json``) in ``dtype``
    (``shapes``: the weights' shapes, when the caller has read them already)."""
    weights, config_file = weight_and_config_files(files)
    if not weights:
        raise InputError(f"no weight files among {[str(f) for f in files][:3]} for the {fmt.component}")
    config = _config_of(fmt, weights, config_file, shapes)
    try:
        if fmt.library == "transformers" and fmt.convert is None:  # transformers knows its checkpoints' renames
            model = _from_pretrained(fmt, weights, config, dtype)
        else:
            model = _from_converted(fmt, weights, config, dtype)
    except (ValueError, ZeroDivisionError, TypeError, KeyError, IndexError, RuntimeError) as exc:
        if isinstance(exc, InputError) or classify(exc) is not None:  # ours already, or the disk's
            raise
        # the class refuses the config derived from these shapes (GroupNorm groups, a head count): the
        # files are not what they look like, which re-running cannot change
        detail = " ".join(str(exc).split())[:200]
        raise InputError(f"{weights[0]}: {fmt.class_name} cannot be built from the config its shapes give "
                         f"({type(exc).__name__}: {detail}); are these {fmt.description}?") from exc
    check_materialised(model, weights[0])
    model = model.eval()
    return model.to(device) if torch.device(device).type != "cpu" else model


def load_tokenizer(files: Sequence[Path]):
    """A tokenizer from its folder (the common folder of ``files``), as the folder's config names it."""
    from transformers import AutoTokenizer

    folder = Path(os.path.commonpath([str(Path(f).parent) for f in files]))
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot load a tokenizer from {folder} ({exc}); point the tokenizer at the "
                         "release's tokenizer folder") from exc


def find_format(formats: Sequence[ReleasedFormat], component: str, files: Sequence[Path],
                shapes: Shapes | None = None) -> ReleasedFormat:
    """The format of ``component`` these files are in; an error naming the files when none fits
    (``shapes``: the weights' shapes, when the caller has read them already)."""
    weights, _ = weight_and_config_files(files)
    if shapes is None:
        shapes = read_shapes(weights) if weights else {}
    matches = [fmt for fmt in formats if fmt.component == component and fmt.recognise(shapes)]
    if not matches:
        known = "; ".join(fmt.description for fmt in formats if fmt.component == component) or "none"
        where = weights[0] if weights else (files[0] if files else "<no files>")
        raise InputError(f"{where}: not a {component} this family can load (known formats: {known})")
    return matches[0]


def t5_encoder_config(s: Shapes, model_type: str) -> dict[str, Any]:
    """T5 v1.1 / UMT5 encoder config from transformers-named weights (``model_type`` "t5" or "umt5").

    Sizes come from the weights; the rest are the released XXL models' facts (DiffSynth's
    flux_text_encoder_t5.py; google/umt5-xxl): gated GELU, 128 max relative distance, eps 1e-6.
    """
    embed = s["shared.weight"] if "shared.weight" in s else s["encoder.embed_tokens.weight"]
    buckets, heads = s["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    arch = "T5EncoderModel" if model_type == "t5" else "UMT5EncoderModel"
    return dict(model_type=model_type, architectures=[arch], vocab_size=embed[0], d_model=embed[1],
                d_kv=s["encoder.block.0.layer.0.SelfAttention.q.weight"][0] // heads,
                d_ff=s["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"][0],
                num_layers=count_indices(s, "encoder.block."), num_decoder_layers=count_indices(s, "encoder.block."),
                num_heads=heads, relative_attention_num_buckets=buckets, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, tie_word_embeddings=False,
                pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def load_named(formats: Sequence[ReleasedFormat], component: str, files: Sequence[Path], dtype: torch.dtype,
               device: str | torch.device = "cpu") -> Any:
    """Component ``component`` from its files: a tokenizer folder (no weights) or weights in one of ``formats``."""
    weights, _ = weight_and_config_files(files)
    if not weights and component == "processor":  # a VL model's processor (the Qwen-Image-Edit releases)
        from .qwen_vl_processor import load_processor

        return load_processor(Path(os.path.commonpath([str(Path(f).parent) for f in files])))
    if not weights:
        return load_tokenizer(files)
    shapes = read_shapes(weights)  # read once: to recognise the format and to infer its config
    return load_component(find_format(formats, component, files, shapes), files, dtype, device, shapes)


def build_on_meta(formats: Sequence[ReleasedFormat], component: str, files: Sequence[Path]) -> torch.nn.Module:
    """The component built on the meta device from its files' config (no weight is read): for early checks."""
    weights, config_file = weight_and_config_files(files)
    shapes = read_shapes(weights) if weights else {}  # read once: to recognise the format and to infer its config
    fmt = find_format(formats, component, files, shapes)
    return _on_meta(fmt, _config_of(fmt, weights, config_file, shapes))


def build_folder_component_on_meta(path: Path, component: str) -> torch.nn.Module:
    """Component ``component`` of a diffusers-layout folder, built on the meta device from its config.json."""
    from accelerate import init_empty_weights

    from .loading import read_model_index

    library, class_name = read_model_index(path)[component]
    cls = _library_class(library, class_name)
    with MODEL_INIT_LOCK, init_empty_weights():
        if library == "diffusers":
            return cls.from_config(cls.load_config(Path(path) / component))
        return cls(cls.config_class.from_pretrained(Path(path) / component))
