"""Two real gloo processes train like one process accumulating the same two samples per step."""

import copy

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffsynth_core.training.loop import Trainer
from stages.config import OffloadSection, TrainSection

from .toy import TOY_SPEC, ToyDiT, toy_samples

OPTIONS = dict(lora_rank=4, max_steps=3, learning_rate=1e-2, seed=1, gradient_checkpointing=False, max_grad_norm=None)


def _lora(model):
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


def _worker(rank, init_file, base, out_dir, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        trainer = Trainer(TOY_SPEC, base, toy_samples(8), TrainSection(**OPTIONS), OffloadSection(),
                          out_dir / f"rank{rank}", progress=False)
        results[rank] = _lora(trainer.fit().model)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_end_identical_and_equal_to_one_process_with_accumulation(tmp_path):
    torch.manual_seed(0)
    base = ToyDiT()
    single = Trainer(TOY_SPEC, copy.deepcopy(base), toy_samples(8),
                     TrainSection(**OPTIONS, gradient_accumulation_steps=2), OffloadSection(), tmp_path / "single",
                     progress=False).fit()
    expected = _lora(single.model)

    results = mp.Manager().dict()
    mp.spawn(_worker, args=(tmp_path / "init", base, tmp_path, results), nprocs=2, join=True)
    rank0, rank1 = results[0], results[1]
    for name in expected:
        assert torch.equal(rank0[name], rank1[name]), name
        torch.testing.assert_close(rank0[name], expected[name], rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "rank1" / "checkpoints").exists()  # only rank 0 writes
