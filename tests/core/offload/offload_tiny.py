"""Tiny real models for the offload tests: a toy MLP stack and tiny diffusers DiTs with peft LoRA."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ToyStack(nn.Module):
    """Embed -> blocks -> head, plus the awkward bits: a root parameter used outside any block,
    a mutable buffer, a plain-attribute tensor and a module called twice per forward."""

    def __init__(self, d: int = 16, n: int = 5):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d))  # root-level, read in forward directly
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))  # mutated in place
        self.offset = torch.full((d,), 0.5)  # plain attribute, not registered

    def forward(self, x):
        self.calls += 1
        x = self.embed(x) * self.scale + self.offset.to(x.device)
        for block in self.blocks:
            x = block(x)
        x = self.blocks[0](x)  # the first block runs twice per step
        return self.head(x)


def add_lora(model: nn.Module, targets, rank: int = 4) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), init_lora_weights="gaussian")
    model = inject_adapter_in_model(cfg, model)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


def tiny_dit(family: str, seed: int = 0) -> tuple[nn.Module, tuple[str, ...], dict]:
    """(model with LoRA, block container names, forward kwargs) for a tiny diffusers DiT."""
    import diffusers

    torch.manual_seed(seed)
    if family == "qwen_image":
        model = diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32,
            num_attention_heads=2, joint_attention_dim=64, axes_dims_rope=(8, 12, 12))
        h = w = 4
        kwargs = dict(hidden_states=torch.randn(1, h * w, 64), encoder_hidden_states=torch.randn(1, 8, 64),
                      encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long),
                      timestep=torch.tensor([0.5]), img_shapes=[[(1, h, w)]], return_dict=False)
        return add_lora(model, ["to_q", "to_k", "to_v", "to_out.0", "img_mod.1"]), ("transformer_blocks",), kwargs
    if family == "flux":
        model = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=32,
            num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(8, 12, 12))
        n_img, n_txt = 16, 8
        img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
        kwargs = dict(hidden_states=torch.randn(1, n_img, 64), encoder_hidden_states=torch.randn(1, n_txt, 64),
                      pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                      img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(n_txt, 3),
                      guidance=torch.tensor([3.5]), return_dict=False)
        return (add_lora(model, ["to_q", "to_k", "to_v", "proj_mlp", "proj_out"]),
                ("transformer_blocks", "single_transformer_blocks"), kwargs)
    if family == "wan":
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=16, out_channels=16,
            text_dim=64, freq_dim=256, ffn_dim=128, num_layers=2)
        kwargs = dict(hidden_states=torch.randn(1, 16, 1, 8, 8), timestep=torch.tensor([500.0]),
                      encoder_hidden_states=torch.randn(1, 8, 64), return_dict=False)
        return add_lora(model, ["to_q", "to_k", "to_v", "ffn.net.0.proj"]), ("blocks",), kwargs
    raise ValueError(family)


def budget_for(model, extra_bytes: float, **opts) -> float:
    """A ``vram_budget_gb`` that leaves ``extra_bytes`` for resident units on a CPU target (where the
    engine counts only what it placed itself: weights outside the units and the slots)."""
    from diffsynth_core.offload import OffloadTrainingManager

    probe = OffloadTrainingManager(model, "cpu", **opts)
    fixed = probe.report()["fixed_device_bytes"]
    probe.detach()
    return (fixed + extra_bytes) / 2**30


def out_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def train(model, steps, loss_fn, mgr=None, accumulate=1, lr=1e-2, fused=None):
    """Run ``steps`` optimizer steps; return losses and the trainable gradients of every step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=fused)
    losses, grads = [], []
    for step in range(steps):
        for micro in range(accumulate):
            loss = loss_fn(step, micro)
            loss.backward()
            if mgr is not None:
                mgr.after_backward()
            losses.append(loss.detach().float().cpu())
        grads.append([p.grad.detach().float().cpu().clone() for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def family_runs_with_and_without_engine(spec, inputs, checkpoint: bool, steps: int = 3):
    """LoRA training of ``spec``'s tiny DiT on its default targets, without then with the offload engine
    (evicted weights poisoned): each run's (losses, gradients), and the engine's streamed unit count.
    ``inputs(model) -> (latents, sigmas, cond)``."""
    from diffsynth_core.gradient import apply_gradient_checkpointing
    from diffsynth_core.offload import OffloadTrainingManager
    from diffsynth_core.training.lora import resolve_lora_targets

    runs, streamed = [], None
    for engine in (False, True):
        model = spec.build_transformer("tiny", torch.float32, "cpu")
        torch.manual_seed(0)
        model = add_lora(model, resolve_lora_targets(model, spec.lora_target_modules))
        if checkpoint:
            apply_gradient_checkpointing(model, spec.block_container_names)
        mgr = (OffloadTrainingManager(model, "cpu", block_container_names=spec.block_container_names,
                                      poison_evicted=True) if engine else None)
        latents, sigmas, cond = inputs(model)
        runs.append(train(model, steps, lambda s, m: spec.dit_forward(model, latents + s, sigmas, cond).pow(2).mean(),
                          mgr))
        if mgr is not None:
            streamed = mgr.report()["streamed_units"]
            mgr.detach()
    return runs, streamed


def assert_equal_runs(runs, steps: int = 3) -> None:
    """Two runs' losses and every step's gradients equal bitwise."""
    (la, ga), (lb, gb) = runs
    assert len(la) == steps and all(torch.equal(x, y) for x, y in zip(la, lb))
    assert all(len(a) > 0 and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(ga, gb))


# --- a plain chain of Linears, for the optimizer-state tests (HostOptimizerState, StepInBackward) ---
CHAIN_WIDTH, CHAIN_DEPTH = 64, 6


class Chain(nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(CHAIN_WIDTH, CHAIN_WIDTH) for _ in range(CHAIN_DEPTH))
        self.checkpointed = checkpointed

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
            x = torch.tanh(x)
        return x


def chain_optimizer(kind: str, params) -> torch.optim.Optimizer:
    """``adamw``, ``fused`` (torch's fused AdamW) or ``sgd`` (with momentum and weight decay)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=1e-3, fused=kind == "fused")


def train_chain(model, optimizer, steps, scheduler=None) -> list[float]:
    """One plain step (backward, ``optimizer.step()``) per item of ``steps``, each on its own batch."""
    losses = []
    for step in steps:
        x = torch.randn(32, CHAIN_WIDTH, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def state_tensors(optimizer) -> list[torch.Tensor]:
    """The optimizer's per-weight state tensors (not scalars such as AdamW's ``step`` count)."""
    return [v for entry in optimizer.state.values() for v in entry.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1]


def assert_same_runs(runs) -> None:
    """``runs``: two (losses, weights) of one training done two ways: equal losses, bitwise weights."""
    (losses, weights), (other_losses, other_weights) = runs
    assert losses == other_losses
    for expected, got in zip(weights, other_weights):
        assert torch.equal(expected, got)
