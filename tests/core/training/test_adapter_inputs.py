"""``train.lora_narrow_inputs``: LoRA adapters save their bf16 input, not peft's fp32 copy; same
losses and gradients to the bit (real diffusers DiTs of every family with real peft adapters),
fewer saved bytes; off unless asked for."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from diffsynth_core.gradient import apply_gradient_checkpointing
from diffsynth_core.models import get_family
from diffsynth_core.models.random_models import build_random_transformer
from diffsynth_core.training.adapter_inputs import NarrowInputLinear, keep_adapter_inputs_narrow, project_down
from diffsynth_core.training.lora import inject_lora


def _step(family: str, narrow: bool, device: torch.device, checkpointing: bool = False):
    """Loss, LoRA gradients and bytes autograd saved for one forward/backward of a bf16 tiny DiT."""
    torch.manual_seed(0)  # peft draws lora_A from the global generator
    spec, module = get_family(family), importlib.import_module(f"diffsynth_core.models.{family}")
    model = build_random_transformer(module.TRANSFORMER_CLASS, {"w": module.TRANSFORMER_CONFIGS["tiny"]}, "w",
                                     torch.bfloat16, device)
    inject_lora(model, spec.lora_target_modules, rank=4)
    if narrow:
        assert keep_adapter_inputs_narrow(model) > 0
    if checkpointing:
        apply_gradient_checkpointing(model, spec.block_container_names)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero, which would leave lora_A without a gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    latents, cond = spec.dummy_inputs(model.config, batch=1, height=64, width=64, text_len=16, seed=0)
    latents, cond = latents.to(device), {k: v.to(device) for k, v in cond.items()}
    # Activations only, by storage: a tensor saved twice (q, k and v's shared input) is held once.
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, adapted_inputs = {}, []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = (storage.nbytes(), t.dtype)
        return t

    for layer in model.modules():
        if hasattr(layer, "lora_A"):
            layer.register_forward_pre_hook(lambda _m, args: adapted_inputs.append(args[0].numel()))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pred = spec.dit_forward(model, latents, torch.tensor([0.5], device=device), cond)
    saved_bytes = {"all": sum(n for n, _ in saved.values()),
                   "fp32": sum(n for n, dtype in saved.values() if dtype == torch.float32),
                   "adapted_input_elements": sum(adapted_inputs)}
    loss = pred.float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
    return loss.detach(), grads, saved_bytes


@pytest.mark.parametrize("family", ["qwen_image", "flux", "wan"])
def test_narrow_adapter_inputs_give_peft_gradients_bitwise_and_save_fewer_bytes(family):
    cpu = torch.device("cpu")
    loss, grads, saved_bytes = _step(family, narrow=True, device=cpu)
    peft_loss, peft_grads, peft_saved_bytes = _step(family, narrow=False, device=cpu)
    assert torch.equal(loss, peft_loss)
    assert grads.keys() == peft_grads.keys() and any(g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n)
    for name, grad in grads.items():
        assert torch.equal(grad, peft_grads[name]), name
    _assert_fp32_copies_gone(saved_bytes, peft_saved_bytes)


def _assert_fp32_copies_gone(narrow: dict, peft: dict) -> None:
    """peft saved one fp32 copy of each adapted Linear's input; the narrow path none, and at most
    one bf16 input per Linear in their place."""
    elements = peft["adapted_input_elements"]
    assert elements > 0 and narrow["fp32"] == peft["fp32"] - 4 * elements
    assert narrow["all"] <= peft["all"] - 2 * elements


def test_inside_checkpointed_blocks_the_gradients_stay_bitwise():
    cpu = torch.device("cpu")
    loss, grads, _ = _step("qwen_image", narrow=True, device=cpu, checkpointing=True)
    peft_loss, peft_grads, _ = _step("qwen_image", narrow=False, device=cpu, checkpointing=True)
    assert torch.equal(loss, peft_loss) and all(torch.equal(g, peft_grads[n]) for n, g in grads.items())


def test_project_down_matches_autograd_of_the_cast_for_odd_shapes():
    gen = torch.Generator().manual_seed(0)
    for shape in [(3, 5, 24), (7, 24), (2, 1, 3, 24)]:
        x = torch.randn(shape, generator=gen).to(torch.bfloat16).requires_grad_(True)
        w = torch.randn(6, 24, generator=gen, requires_grad=True)
        grad_out = torch.randn(*shape[:-1], 6, generator=gen)
        ours = torch.autograd.grad(project_down(x, w), (x, w), grad_out)
        theirs = torch.autograd.grad(nn.functional.linear(x.float(), w), (x, w), grad_out)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), shape


def _project_down_and_autograd(shape, rank, device, dtype=torch.bfloat16):
    """Gradients of ``x`` and ``w`` through ``project_down`` and through autograd of peft's cast."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype).to(device).requires_grad_(True)
    w = (torch.randn(rank, shape[-1], generator=gen) * 0.02).to(device).requires_grad_(True)
    grad_out = torch.randn(*shape[:-1], rank, generator=gen).to(device)
    ours = torch.autograd.grad(project_down(x, w), (x, w), grad_out)
    theirs = torch.autograd.grad(nn.functional.linear(x.float(), w), (x, w), grad_out)
    return ours, theirs


def test_the_input_gradient_made_in_slices_of_rows_is_autograds_to_the_bit(monkeypatch):
    """Slices of 2 x 256 rows (and a last one of 256), against autograd's one product; a row count
    that is no multiple of 256 is left whole."""
    from diffsynth_core.training import adapter_inputs

    monkeypatch.setattr(adapter_inputs, "GRAD_SLICE_BYTES", 2 * 256 * 40 * 4)
    slices = []
    mm = torch.Tensor.mm
    monkeypatch.setattr(torch.Tensor, "mm", lambda a, b: slices.append(a.shape[0]) or mm(a, b))
    for shape, made in [((1, 768, 40), [512, 256]), ((2, 640, 40), [512, 512, 256]), ((1, 1000, 40), [1000])]:
        slices.clear()
        ours, theirs = _project_down_and_autograd(shape, 6, torch.device("cpu"))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), shape
        assert [n for n in slices if n != 6] == made, shape  # (6 rows: the weight's gradient)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,width,rank", [(4096, 12288, 32), (4608, 12288, 16), (16384, 3072, 32),
                                                (8192, 13824, 128), (4096, 15360, 64)])
def test_at_real_widths_the_sliced_gradients_are_autograds_to_the_bit_on_cuda(tokens, width, rank):
    """cuBLAS at MLP widths of the stack benchmark, FLUX, Qwen-Image and Wan: the input's fp32
    gradient made in slices of 256-multiples of rows, against autograd's one product."""
    ours, theirs = _project_down_and_autograd((1, tokens, width), rank, torch.device("cuda"))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.gpu
def test_at_the_stacks_mlp_the_forward_and_backward_hold_less_on_cuda(monkeypatch):
    """4096 tokens, 12288 wide, from before the forward to the end of the backward: peft's path saves
    a 192 MiB fp32 copy of x and holds its 192 MiB fp32 gradient beside the 96 MiB cast; ours saves
    none, and its x's fp32 copy (for the weight's gradient) is gone before x's gradient is made, 60
    MiB of fp32 rows at a time; made whole, that gradient and its cast would be 288 MiB at once."""
    from diffsynth_core.training import adapter_inputs

    cuda = torch.device("cuda")
    peaks = {}
    for name, project in (("sliced", project_down), ("whole", project_down),
                          ("peft", lambda x, w: nn.functional.linear(x.float(), w))):
        monkeypatch.setattr(adapter_inputs, "GRAD_SLICE_BYTES", 1 << 40 if name == "whole" else 64 << 20)
        x = torch.randn(1, 4096, 12288, device=cuda).to(torch.bfloat16).requires_grad_(True)
        w = torch.randn(32, 12288, device=cuda, requires_grad=True)
        grad_out = torch.ones(1, 4096, 32, device=cuda)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        project(x, w).backward(grad_out)
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del x, w, grad_out
    assert peaks["sliced"] <= peaks["whole"] - 80 and peaks["sliced"] <= peaks["peft"] - 160, peaks


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen_image", "flux", "wan"])
def test_narrow_adapter_inputs_give_peft_gradients_on_cuda(family):
    """cuBLAS: the same mm calls as autograd's, so the same bits (attention's backward is made
    deterministic so the two runs differ only in the adapters' path)."""
    from diffsynth_core.training.device import avoid_broken_kernels

    avoid_broken_kernels("cuda")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        cuda = torch.device("cuda")
        loss, grads, saved_bytes = _step(family, narrow=True, device=cuda)
        peft_loss, peft_grads, peft_saved_bytes = _step(family, narrow=False, device=cuda)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(loss, peft_loss)
    assert all(torch.equal(g, peft_grads[n]) for n, g in grads.items())
    _assert_fp32_copies_gone(saved_bytes, peft_saved_bytes)


def test_the_setting_switches_the_adapters_path_and_is_off_by_default():
    from diffsynth_core.training.prepare import prepare_for_training
    from stages.config import OffloadSection, TrainSection

    spec, module = get_family("wan"), importlib.import_module("diffsynth_core.models.wan")
    counts = {}
    for narrow in (False, True):
        model = build_random_transformer(module.TRANSFORMER_CLASS, {"w": module.TRANSFORMER_CONFIGS["tiny"]}, "w",
                                         torch.bfloat16, torch.device("cpu"))
        train = TrainSection(lora_rank=4, lora_narrow_inputs=narrow) if narrow else TrainSection(lora_rank=4)
        prepared = prepare_for_training(model, spec, train, OffloadSection(), torch.device("cpu"))
        counts[narrow] = sum(type(m) is NarrowInputLinear for m in prepared.model.modules())
    assert counts[False] == 0 and counts[True] > 0


def test_layers_with_dropout_keep_peft_path():
    """Dropout would run on the bf16 input instead of peft's fp32 copy: a different result, so such
    layers are left alone."""
    from peft import LoraConfig, inject_adapter_in_model

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
    config = LoraConfig(r=2, target_modules=["0"], lora_dropout=0.1)
    inject_adapter_in_model(config, model)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["1"]), model, adapter_name="plain")
    assert keep_adapter_inputs_narrow(model) == 1
    assert type(model[0].lora_A["default"]) is nn.Linear and model[0].cast_input_dtype_enabled
    assert type(model[1].lora_A["plain"]) is NarrowInputLinear and not model[1].cast_input_dtype_enabled
