"""``train.compile_blocks``: real torch.compile (Inductor's C++ backend on this CPU) on a tiny
diffusers Qwen-Image DiT trained through the real Trainer, with LoRA, checkpointing and the
offload engine around the compiled blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffsynth_core.errors import InputError
from diffsynth_core.training.compile import compile_blocks
from diffsynth_core.training.loop import Trainer
from stages.config import OffloadSection, RunConfig, TrainSection

from .toy import tiny_family_dit

pytestmark = pytest.mark.slow  # one cold compile: ~40 s on 2 cores
CPU = torch.device("cpu")


def _fit(out, compile_: bool, offload: bool, device: torch.device = CPU, family: str = "qwen_image"):
    spec, model, samples = tiny_family_dit(family, torch.float32)
    train = TrainSection(lora_rank=4, max_steps=3, seed=0, gradient_checkpointing=True, device=str(device),
                         compile_blocks=compile_)
    result = Trainer(spec, model, samples, train, OffloadSection(enable_model_cpu_offload=offload), out,
                     device=device, progress=False).fit()
    lora = {k: v.detach().clone() for k, v in result.model.named_parameters() if "lora_" in k}
    return result.losses, lora, result.model


def test_compiled_blocks_train_like_eager_ones_inside_offload_and_checkpointing(tmp_path):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager_losses, eager_lora, _ = _fit(tmp_path / "eager", compile_=False, offload=True)
    losses, lora, model = _fit(tmp_path / "compiled", compile_=True, offload=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled, not silently eager
    assert all(getattr(b, "_splitflow_compiled", False) for b in model.transformer_blocks)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    for name, weight in eager_lora.items():
        torch.testing.assert_close(lora[name], weight, rtol=1e-4, atol=1e-6, msg=name)
    again, again_lora, _ = _fit(tmp_path / "again", compile_=True, offload=True)  # a compiled CPU run repeats exactly
    assert again == losses and all(torch.equal(again_lora[k], lora[k]) for k in lora)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen_image", "flux", "wan"])
def test_compiled_blocks_train_like_eager_ones_on_cuda_with_streamed_blocks(family, tmp_path):
    """The same through Triton on a GPU, every block streamed by the engine (fp32: TF32 off so the
    two differ only by the compiled kernels' rounding)."""
    from diffsynth_core.training.device import avoid_broken_kernels

    avoid_broken_kernels("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cuda = torch.device("cuda")
    eager_losses, eager_lora, _ = _fit(tmp_path / "eager", compile_=False, offload=True, device=cuda, family=family)
    losses, lora, model = _fit(tmp_path / "compiled", compile_=True, offload=True, device=cuda, family=family)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    # Looser than on the CPU: an eager CUDA backward is not bitwise repeatable itself (atomics), and
    # AdamW's first steps turn tiny gradient differences into lr-sized ones in single elements.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=2e-3, atol=1e-5)
    for name, weight in eager_lora.items():
        drift = (lora[name] - weight).norm() / weight.norm().clamp_min(1e-12)
        assert drift < 1e-2, f"{name}: compiled LoRA weights {drift:.2e} away from eager ones"
    torch._dynamo.reset()


def test_a_machine_that_cannot_compile_stops_at_the_first_step_in_one_line(tmp_path, monkeypatch):
    import torch._inductor.config as inductor

    torch._dynamo.reset()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing compiled before
    stack = nn.Sequential(nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)]))
    assert compile_blocks(stack) == 2
    with inductor.patch({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))}):
        with pytest.raises(InputError, match=r"^train\.compile_blocks: torch\.compile cannot compile the blocks "
                                             r"on this machine \(InvalidCxxCompiler: .*no-such-g\+\+.*\); "
                                             r"set train\.compile_blocks = false$") as caught:
            stack[0][0](torch.randn(3, 8) * 1.37)
    assert "\n" not in str(caught.value)
    torch._dynamo.reset()


def test_compiled_and_deterministic_together_are_refused_naming_both_keys():
    with pytest.raises(ValueError, match="train.compile_blocks and train.deterministic"):
        RunConfig.model_validate({"train": {"compile_blocks": True, "deterministic": True}})
