"""Apply the training techniques to a DiT, in one documented order.

``prepare_for_training`` runs, in this order:

1. fuse a preset LoRA into the base weights (it must see the plain base Linear layers);
2. choose what trains: a LoRA adapter (peft; fresh, or continued from ``train.lora_checkpoint``
   with that file's rank, alpha, targets and weights) or whole components (full fine-tuning);
   with ``train.lora_narrow_inputs`` the adapters save their input as it came (adapter_inputs.py);
3. gradient checkpointing per block (it wraps the blocks that LoRA has already modified);
4. device placement: the offload engine streams frozen weights from host memory, or the
   whole model moves to the device (the engine must see the final module tree and know
   which parameters train, so it comes after 2 and 3);
5. the optimizer over the trainable parameters, built last so it holds the parameter
   objects that will actually receive gradients (on the CPU under optimizer offload).

Options come from ``train`` and ``offload`` sections (any objects with the attributes of
``stages.config.TrainSection`` / ``OffloadSection``); the core never imports the config module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.base import FamilySpec
from . import optimizers
from .adapter_inputs import keep_adapter_inputs_narrow
from .experts import ExpertModels, block_containers
from .lora import fuse_lora_file, inject_lora, inject_lora_from_file
from ..errors import InputError

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    model: nn.Module
    trainable: dict[str, nn.Parameter]   # parameter name -> parameter, stable order
    lora_config: dict[str, Any] | None   # None for full fine-tuning
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    offload: Any | None                  # OffloadTrainingManager when streaming weights
    host_state: Any | None = None        # HostOptimizerState under offload.optimizer_state_on_host
    steps_in_backward: Any | None = None  # StepInBackward under offload.optimizer_step_in_backward


def build_optimizer(class_path: str, params, learning_rate: float, weight_decay: float, on_host: bool = False,
                    optimizer_args: dict[str, Any] | None = None, fused: bool = False) -> torch.optim.Optimizer:
    """Instantiate the allowed optimizer ``class_path`` (default torch.optim.AdamW) over ``params``.

    Only torch.optim classes and the packages listed in ``optimizers.PACKAGES`` can be named.
    ``on_host``: the parameters step on the CPU (optimizer offload), where torch's fused
    Adam/AdamW kernel is several times faster than the default for-each one.  ``fused``: built
    fused where the class can be (``optimizers.SKIPPABLE_FUSED``: steps during backward skip on the device).
    ``optimizer_args`` (``train.optimizer_args``): more constructor arguments; they win over those defaults.
    """
    optimizer_class = optimizers.optimizer_class(class_path)
    wants_fused = (on_host and optimizer_class in (torch.optim.Adam, torch.optim.AdamW)) or \
        (fused and optimizers.skippable_fused(class_path))
    extra = {"fused": True} if wants_fused else {}
    extra.update(optimizers.checked_args(optimizer_class, class_path, dict(optimizer_args or {})))
    try:
        return optimizer_class(params, lr=learning_rate, weight_decay=weight_decay, **extra)
    except (ValueError, TypeError, RuntimeError) as err:  # the optimizer's own check of a value
        if not optimizer_args:
            raise
        detail = " ".join(str(err).split())[:300]
        raise InputError(f"train.optimizer_args: {class_path} refused {dict(optimizer_args)}: {detail}") from None


def constant_with_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Constant LR after an explicit linear warm-up (none by default, unlike the reference's 1/3 start)."""
    def factor(step: int) -> float:
        return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _choose_trainable(model: nn.Module, spec: FamilySpec, train) -> dict[str, Any] | None:
    full_finetune = spec.transformer_component in train.trainable_models
    if full_finetune and train.lora_rank > 0:
        raise InputError("train.trainable_models includes the transformer and train.lora_rank > 0: "
                         "choose LoRA (lora_rank > 0) or full fine-tuning (lora_rank = 0), not both")
    unknown = set(train.trainable_models) - {spec.transformer_component}
    if unknown:
        raise InputError(f"train.trainable_models: {sorted(unknown)} cannot be trained from the cache; "
                         f"stage 2 holds only {spec.transformer_component!r}")
    lora_checkpoint = getattr(train, "lora_checkpoint", None)
    if full_finetune:
        if lora_checkpoint:
            raise InputError("train.lora_checkpoint continues a LoRA; it cannot be combined with full fine-tuning "
                             "(train.trainable_models includes the transformer)")
        model.requires_grad_(True)
        return None
    if lora_checkpoint:
        config = inject_lora_from_file(model, lora_checkpoint, spec.native_module_name)
        log.info("continuing the LoRA of %s: rank %s, alpha %s, %d modules (its own settings, not train.lora_*)",
                 lora_checkpoint, config["r"], config["lora_alpha"], len(config["target_modules"]))
        return config
    if train.lora_rank <= 0:
        raise InputError("nothing to train: set train.lora_rank > 0 or train.trainable_models = ['transformer']")
    targets = train.lora_target_modules or list(spec.lora_target_modules)
    return inject_lora(model, targets, train.lora_rank, train.lora_alpha, train.lora_init)


# Under a budget the checkpointed block inputs may take at most this share of it: the rest holds the
# streaming slots, the resident blocks the planner keeps and the recompute of one block.
ACTIVATION_SHARE_OF_BUDGET = 0.5


def checkpointed_input_bytes(model: nn.Module, spec: FamilySpec, batch: int, latent_shape) -> int:
    """Bytes the blocks' checkpointed inputs take in one step: every block keeps its input, ``tokens x
    width`` in the model's dtype, tokens as the loop counts them (latent elements per channel over the
    family's ``latent_patch``²)."""
    from ..offload.units import find_blocks

    blocks = find_blocks(model, block_containers(model, spec))
    if isinstance(model, ExpertModels):  # one expert's blocks run in a step (video batches of one)
        blocks = blocks[: len(blocks) // len(model.experts)]
    if not blocks:
        return 0
    first = next(m for m in blocks[0].modules() if isinstance(m, nn.Linear))
    tokens = 1
    for d in latent_shape[1:]:
        tokens *= int(d)
    weight = getattr(first, "base_layer", first).weight
    return len(blocks) * batch * (tokens // spec.latent_patch ** 2) * first.in_features * weight.element_size()


def activations_need_host(train, offload, device: torch.device, model: nn.Module, spec: FamilySpec,
                          latent_shape=None) -> bool:
    """``train.gradient_checkpointing_offload``, "auto" resolved: on when a GPU budget is set and the
    checkpointed inputs of the largest batch would take more than ``ACTIVATION_SHARE_OF_BUDGET`` of it."""
    choice = getattr(train, "gradient_checkpointing_offload", False)
    if choice != "auto":
        return bool(choice)
    budget = getattr(offload, "vram_budget_gb", 0) if offload.enable_model_cpu_offload else 0
    if device.type != "cuda" or not budget or latent_shape is None:
        return False
    if budget == "auto":
        budget = torch.cuda.mem_get_info(device)[0] * 0.95 / 2**30
    needed = checkpointed_input_bytes(model, spec, train.batch_size, latent_shape)
    chosen = needed > ACTIVATION_SHARE_OF_BUDGET * float(budget) * 2**30
    log.info("checkpointed block inputs: %.2f GiB a step against a %.1f GiB budget: %s", needed / 2**30,
             float(budget), "kept in host memory" if chosen else "kept on the GPU")
    return chosen


def _enable_checkpointing(model: nn.Module, spec: FamilySpec, train, offload_activations: bool) -> None:
    if not train.gradient_checkpointing:
        return
    try:
        from ..gradient import apply_gradient_checkpointing
    except ImportError:  # engine not available: fall back to diffusers' own per-block wrapper
        model.enable_gradient_checkpointing()
        return
    apply_gradient_checkpointing(model, block_containers(model, spec), offload_activations=offload_activations)


def _place(model: nn.Module, spec: FamilySpec, offload, device: torch.device):
    if not offload.enable_model_cpu_offload:
        model.to(device)
        return None
    from ..offload import OffloadTrainingManager

    return OffloadTrainingManager(
        model, device,
        enable_optimizer_cpu_offload=offload.enable_optimizer_cpu_offload,
        cpu_offload_split_threshold=offload.cpu_offload_split_threshold,
        block_container_names=block_containers(model, spec),
        granularity=offload.granularity,
        prefetch=offload.prefetch,
        vram_budget_gb=offload.vram_budget_gb,
        storage_dtype=_storage_dtype(offload.storage_dtype),
    )


def _storage_dtype(name: str | None):
    """The engine's ``storage_dtype`` for ``offload.storage_dtype``: a torch dtype, or the packed
    bf16 format's name as it is."""
    from ..offload.packed import PACKED

    return name if name in (None, PACKED) else getattr(torch, name)


def prepare_for_training(model: nn.Module, spec: FamilySpec, train, offload, device: torch.device,
                         latent_shape=None) -> Prepared:
    """``latent_shape``: the largest batch's latents ``(C, f, h, w)``, which "auto" activation offload reads."""
    if getattr(offload, "optimizer_step_in_backward", False):
        _refuse_what_cannot_step_in_backward(train, offload)
    if train.preset_lora_path:
        fuse_lora_file(model, train.preset_lora_path, rename=spec.native_module_name)
    elif spec.extras.get("training_notice"):  # e.g. a distilled variant trained as a base model, without an adapter
        log.warning("%s", spec.extras["training_notice"])
    torch.manual_seed(train.seed)  # LoRA initialisation is part of the run's reproducibility
    lora_config = _choose_trainable(model, spec, train)
    if lora_config is not None and getattr(train, "lora_narrow_inputs", False):
        keep_adapter_inputs_narrow(model)
    if getattr(train, "compile_blocks", False):  # before checkpointing: it wraps the compiled forward
        from .compile import compile_blocks

        compile_blocks(model, block_containers(model, spec))
    activations_on_host = activations_need_host(train, offload, device, model, spec, latent_shape)
    _enable_checkpointing(model, spec, train, activations_on_host)
    manager = _place(model, spec, offload, device)
    if manager is not None and manager.budget is not None and getattr(train, "gradient_checkpointing", False) \
            and not activations_on_host:
        manager.budget.advice = ", set train.gradient_checkpointing_offload = true (block inputs in host memory)"
    model.train()
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    on_host = manager is not None and offload.enable_optimizer_cpu_offload
    in_backward = getattr(offload, "optimizer_step_in_backward", False)
    optimizer = build_optimizer(train.optimizer, list(trainable.values()), train.learning_rate,
                                train.weight_decay, on_host=on_host,
                                optimizer_args=getattr(train, "optimizer_args", None), fused=in_backward)
    if on_host and manager.plan.host_trainable and not getattr(train, "ema_decay", 0):
        # Host weights step unit by unit off the main thread, once optimizer.step() queues them: never
        # during backward (overlap_backward), since the Trainer's non-finite guard must see every
        # gradient before any weight moves.  Not with an EMA: it reads the weights right after
        # optimizer.step(), before queued host steps ran.
        manager.bind_optimizer(optimizer)
    if manager is not None:
        manager.watch_optimizer(optimizer)  # a budget's plan covers the optimizer step's peak too
    host_state = steps_in_backward = None
    if in_backward:  # pages its state through host memory itself: optimizer_state_on_host has nothing to add
        from ..offload.backward_steps import StepInBackward

        # a page with a NaN/Inf gradient (or all, after a NaN/Inf loss) skips its step on the device.  On a
        # CPU run it pages host to host: pointless for memory, but the steps are a GPU run's (CPU tests).
        steps_in_backward = StepInBackward(optimizer, skip_nonfinite=True)
    elif getattr(offload, "optimizer_state_on_host", False) and device.type == "cuda":
        from ..offload.optimizer_state import HostOptimizerState

        host_state = HostOptimizerState(optimizer)  # on a CPU run the state is in host memory already
    scheduler = constant_with_warmup(optimizer, train.warmup_steps)
    return Prepared(model, trainable, lora_config, optimizer, scheduler, manager, host_state, steps_in_backward)


def _refuse_what_cannot_step_in_backward(train, offload) -> None:
    """Before any work: the config checks the same rule when it is read, but a library caller's
    sections were never validated together, and ranks are known only now."""
    conflict = optimizers.step_in_backward_conflict(train, offload)
    if conflict:
        raise InputError(conflict)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        raise InputError("offload.optimizer_step_in_backward steps each weight before the ranks have averaged its "
                         "gradient: train with one process, or turn it off")
