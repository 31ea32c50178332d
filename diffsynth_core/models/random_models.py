"""DiTs with random weights in released layouts, and random inputs shaped like the cache (benchmarks).

Weights are created directly on the target device in the target dtype (meta init, then one
tensor at a time), so a 20 B-parameter layout needs 1x its bf16 size and no fp32 detour.  The
family's ``_keep_in_fp32_modules`` stay fp32, as ``from_pretrained(dtype=...)`` would leave them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch


def _random_like(name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                 generator: torch.Generator | None) -> torch.Tensor:
    if len(shape) == 1 and name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    if len(shape) == 1:  # norm scales
        return torch.ones(shape, dtype=dtype, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.normal_(0.0, 0.02, generator=generator) if device.type != "meta" else out


def build_random_transformer(class_name: str, configs: Mapping[str, Mapping[str, Any]], variant: str,
                             dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> torch.nn.Module:
    """``diffusers.<class_name>(**configs[variant])`` with N(0, 0.02) weights on ``device`` in ``dtype``."""
    import diffusers

    if variant not in configs:
        raise KeyError(f"unknown transformer variant {variant!r}; known: {', '.join(configs)}")
    return random_module(lambda: getattr(diffusers, class_name)(**configs[variant]), dtype, device, seed)


def random_module(make: Callable[[], torch.nn.Module], dtype: torch.dtype, device: str | torch.device,
                  seed: int = 0) -> torch.nn.Module:
    """``make()`` built on the meta device, then given N(0, 0.02) weights on ``device`` in ``dtype``,
    one tensor at a time.  Tied weights (T5's ``shared`` / ``encoder.embed_tokens``) stay tied;
    the model's ``_keep_in_fp32_modules`` stay fp32."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    from .loading import MODEL_INIT_LOCK
    from .single_file import _target_dtype

    device = torch.device(device)
    with MODEL_INIT_LOCK, init_empty_weights():  # parameters on meta; buffers (RoPE tables) real, on the CPU
        model = make()
    if hasattr(model, "tie_weights"):  # as from_pretrained does (T5: two embedding modules, one table);
        model.tie_weights()            # outside init_empty_weights, whose patch would re-wrap the tied weight
    keep_fp32 = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    generator = torch.Generator(device).manual_seed(seed) if device.type != "meta" else None
    made: dict[int, torch.nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                full = f"{module_name}.{name}" if module_name else name
                value = _random_like(full, param.shape, _target_dtype(full, dtype, keep_fp32), device, generator)
                made[id(param)] = torch.nn.Parameter(value, requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]
    for name, buffer in list(model.named_buffers()):
        set_module_tensor_to_device(model, name, device, value=buffer, dtype=buffer.dtype)
    return model.eval()


def random_tensor(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
