"""Two real gloo processes train like one process accumulating the same two batches per step:
single samples, and bucketed batches of 2 from a cache of two latent shapes with padded prompts."""

import copy

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffsynth_core.errors import InputError
from diffsynth_core.training.loop import Trainer
from diffsynth_core.training.metrics import read_metrics
from stages.config import OffloadSection, TrainSection

from .toy import TOY_PADDED_SPEC, TOY_SPEC, ToyDiT, ToyWithDeadHead, lora_of, mixed_toy_samples, toy_samples

OPTIONS = dict(lora_rank=4, max_steps=3, learning_rate=1e-2, seed=1, gradient_checkpointing=False, max_grad_norm=None)
# (name, spec, samples, options, model).  11 samples of two shapes in batches of 2: 3 full batches of one
# shape, 2 full batches and a last one of 1 sample of the other; 6 batches = 3 steps of 2 ranks; step 4 starts
# epoch 1.  "dead layer": ranks fill missing gradients with zeros to all-reduce them, and weight decay on those
# zeros used to move a never-used layer's LoRA on two ranks but not in one process (issue 9).
CASES = [
    ("single", TOY_SPEC, lambda: toy_samples(8), {}, ToyDiT),
    ("buckets", TOY_PADDED_SPEC, lambda: mixed_toy_samples(11), dict(batch_size=2, max_steps=4), ToyDiT),
    ("dead layer", TOY_SPEC, lambda: toy_samples(4), dict(max_steps=2, lora_target_modules=["proj", "head"]),
     ToyWithDeadHead),
]


def _worker(rank, init_file, bases, out_dir, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for name, spec, samples, options, _ in CASES:
            trainer = Trainer(spec, copy.deepcopy(bases[name]), samples(), TrainSection(**{**OPTIONS, **options}),
                              OffloadSection(), out_dir / f"{name}-rank{rank}", progress=False)
            results[(name, rank)] = lora_of(trainer.fit().model)
        # steps during backward would move each weight before the ranks average its gradient
        trainer = Trainer(TOY_SPEC, ToyDiT(), toy_samples(4), TrainSection(**OPTIONS),
                          OffloadSection(optimizer_step_in_backward=True), out_dir / f"paged-rank{rank}", progress=False)
        try:
            trainer.fit()
        except InputError as err:
            results[("paged", rank)] = str(err)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_end_identical_and_equal_to_one_process_with_accumulation(tmp_path):
    torch.manual_seed(0)
    bases = {name: model() for name, *_, model in CASES}
    expected = {}
    for name, spec, samples, options, _ in CASES:
        train = TrainSection(**{**OPTIONS, **options}, gradient_accumulation_steps=2)
        single = Trainer(spec, copy.deepcopy(bases[name]), samples(), train, OffloadSection(),
                         tmp_path / f"{name}-single", progress=False)
        expected[name] = lora_of(single.fit().model)

    results = mp.Manager().dict()
    mp.spawn(_worker, args=(tmp_path / "init", bases, tmp_path, results), nprocs=2, join=True)
    for name, *_ in CASES:
        rank0, rank1 = results[(name, 0)], results[(name, 1)]
        for key in expected[name]:
            assert torch.equal(rank0[key], rank1[key]), (name, key)
            torch.testing.assert_close(rank0[key], expected[name][key], rtol=1e-5, atol=1e-6)
        assert not (tmp_path / f"{name}-rank1" / "checkpoints").exists()  # only rank 0 writes
    for rank in (0, 1):
        assert "offload.optimizer_step_in_backward steps each weight before the ranks have averaged" in \
            results.get(("paged", rank), "")
    # rank 0 logs every rank's batches: the same samples and buckets per step as the single process
    rows = read_metrics(tmp_path / "buckets-rank0" / "metrics.csv")
    single_rows = read_metrics(tmp_path / "buckets-single" / "metrics.csv")
    assert [(r["samples"], r["bucket"]) for r in rows] == [(r["samples"], r["bucket"]) for r in single_rows]
    assert sum(int(r["samples"]) for r in rows[:3]) == 11  # epoch 0: every sample once, the 1-sample batch too
