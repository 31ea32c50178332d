"""Which optimizers ``train.optimizer`` may name: torch.optim, and a short list of known packages.

The config names a class; it is never an import path to follow.  A name is looked up in
``torch.optim`` or in :data:`PACKAGES` (package module -> its optimizer classes), so no config
can make splitflow import an arbitrary module or call an arbitrary function.  Imports torch
only when an optimizer is built, so the config can check names cheaply.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import InputError

# Optimizer packages users train diffusion LoRAs with (names as each package exports them).
PACKAGES: dict[str, tuple[str, ...]] = {
    "bitsandbytes.optim": ("AdamW8bit", "Adam8bit", "PagedAdamW8bit", "PagedAdamW", "PagedAdamW32bit",
                           "AdamW32bit", "Lion8bit", "PagedLion8bit", "Lion", "SGD8bit", "AdEMAMix8bit"),
    "prodigyopt": ("Prodigy",),
    "came_pytorch": ("CAME",),
}
PIP_NAMES = {"bitsandbytes.optim": "bitsandbytes", "prodigyopt": "prodigyopt", "came_pytorch": "came-pytorch"}
TORCH = "torch.optim"
# torch.optim classes that cannot train a LoRA from the loop's plain ``optimizer.step()``: left out of the
# allow-list, with why.
UNFIT = {
    "LBFGS": "it needs a closure re-evaluating the loss at every step and takes one parameter group",
    "SparseAdam": "it steps sparse gradients only, and a DiT's weights get dense ones",
}


def _torch_optimizers() -> list[str]:
    import torch

    return sorted(name for name in dir(torch.optim) if not name.startswith("_")
                  and isinstance(getattr(torch.optim, name), type)
                  and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
                  and getattr(torch.optim, name) is not torch.optim.Optimizer and name not in UNFIT)


def allowed_names() -> list[str]:
    return [f"{TORCH}.{n}" for n in _torch_optimizers()] + [f"{m}.{c}" for m, cs in PACKAGES.items() for c in cs]


def split_name(name: str) -> tuple[str, str]:
    """``"AdamW"`` / ``"torch.optim.AdamW"`` / ``"prodigyopt.Prodigy"`` -> (module, class); refuses the rest."""
    module, _, cls = name.rpartition(".")
    module = module or TORCH
    if module == TORCH and cls in UNFIT:
        raise InputError(f"train.optimizer = {name!r} cannot train here: {UNFIT[cls]}; use torch.optim.AdamW "
                         "(or another torch.optim class)")
    if module == TORCH or cls in PACKAGES.get(module, ()):
        return module, cls
    listed = ", ".join(f"{m}.{{{','.join(cs)}}}" for m, cs in PACKAGES.items())
    raise InputError(f"train.optimizer = {name!r} is not allowed: use a torch.optim class (e.g. "
                     f"torch.optim.AdamW) or one of {listed}")


# torch.optim classes whose fused kernel reads GradScaler's ``found_inf`` flag, so a step can be skipped
# on the device without waiting for it (offload.optimizer_step_in_backward builds them fused).
SKIPPABLE_FUSED = ("Adam", "AdamW", "SGD")


def skippable_fused(name: str) -> bool:
    module, cls = split_name(name)
    return module == TORCH and cls in SKIPPABLE_FUSED


def step_in_backward_conflict(train: Any, offload: Any) -> str | None:
    """Why ``offload.optimizer_step_in_backward`` cannot run with these sections (None: it can).
    Each weight moves as soon as its gradient is in, so nothing may need every gradient first."""
    key = "offload.optimizer_step_in_backward"
    if getattr(train, "max_grad_norm", None):
        return (f"{key} steps each weight during backward, before the gradient norm to clip by is known: "
                f"set train.max_grad_norm = 0 (no clipping) or turn {key} off")
    if getattr(train, "gradient_accumulation_steps", 1) > 1:
        return (f"{key} steps after every backward, so train.gradient_accumulation_steps must be 1 "
                f"(got {train.gradient_accumulation_steps}); raise train.batch_size instead")
    if getattr(offload, "enable_optimizer_cpu_offload", False):
        return (f"{key} and offload.enable_optimizer_cpu_offload both place the optimizer step (on the GPU "
                "during backward, or on the host): choose one")
    if not skippable_fused(getattr(train, "optimizer", "torch.optim.AdamW")):
        return (f"{key} needs train.optimizer = torch.optim.AdamW, Adam or SGD (their fused kernel lets a page "
                f"with a NaN/Inf gradient skip its step on the GPU), got {train.optimizer!r}")
    if (getattr(train, "optimizer_args", None) or {}).get("fused") is False:
        return (f"{key} needs a fused optimizer (its kernel skips a page's step over NaN/Inf on the GPU): "
                "remove train.optimizer_args.fused")
    return None


def optimizer_class(name: str) -> Any:
    """The class ``name`` denotes, imported only from the allow-list."""
    module, cls = split_name(name)
    if module == TORCH:
        if cls not in _torch_optimizers():
            raise InputError(f"train.optimizer = {name!r}: torch.optim has no optimizer {cls!r}; "
                             f"allowed: {', '.join(_torch_optimizers())}")
        import torch

        return getattr(torch.optim, cls)
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as err:
        raise InputError(f"train.optimizer = {name!r} needs the package {PIP_NAMES[module]!r}, which is not "
                         f"installed here ({err}); pip install {PIP_NAMES[module]}") from None
    except AttributeError:
        raise InputError(f"train.optimizer = {name!r}: the installed {module} has no {cls}; "
                         "upgrade the package or choose another optimizer") from None


# Set by their own train.* keys, so optimizer_args may not name them.
OWN_KEYS = {"params": "the trained parameters", "lr": "train.learning_rate", "weight_decay": "train.weight_decay"}


def checked_args(optimizer_class: Any, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """``train.optimizer_args`` as keyword arguments of ``optimizer_class``: each key must be one of its
    constructor's parameters (a typo fails here, in one line, not as a TypeError mid-setup), and
    lists become tuples (``betas = [0.9, 0.99]`` in TOML)."""
    import inspect

    parameters = inspect.signature(optimizer_class.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    accepted = [p for p in parameters if p != "self" and p not in OWN_KEYS
                and parameters[p].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    for key in args:
        if key in OWN_KEYS:
            raise InputError(f"train.optimizer_args.{key}: set by {OWN_KEYS[key]}, not here")
        if key not in accepted and not takes_any:
            raise InputError(f"train.optimizer_args.{key}: {name} takes no {key!r}; it takes {', '.join(accepted)}")
    return {key: tuple(value) if isinstance(value, list) else value for key, value in args.items()}
