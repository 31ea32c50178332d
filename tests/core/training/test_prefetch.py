"""The next round's batch is read while the round before computes: same batches, same state, errors on time."""

import copy

import pytest
import torch

from diffsynth_core.data.errors import DatasetError
from diffsynth_core.training.loop import Trainer
from diffsynth_core.training.sampler import BucketSampler
from stages.config import OffloadSection, TrainSection

from .toy import TOY_SPEC, ToyDiT, toy_samples


class WatchedSamples:
    """The toy training set, recording each read with the number of steps finished at that moment;
    ``fail_at``: the read (1-based) that raises a cache error instead."""

    def __init__(self, fail_at: int | None = None):
        self.samples, self.fail_at = toy_samples(), fail_at
        self.steps_done, self.reads = 0, []

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        self.reads.append((index, self.steps_done))
        if len(self.reads) == self.fail_at:
            raise DatasetError(f"cache entry of row {index} is unreadable; re-run preprocess")
        return self.samples[index]

    def latent_shape(self, index):  # the sampler's buckets without reading (as the cache manifest gives them)
        return tuple(self.samples[index]["latents"].shape)

    def on_step(self, step, _model):
        self.steps_done = step


def _fit(tmp_path, samples, **options):
    train = TrainSection(**{**dict(lora_rank=4, max_steps=4, save_steps=1, learning_rate=1e-2, seed=5,
                                   gradient_checkpointing=False), **options})
    trainer = Trainer(TOY_SPEC, ToyDiT(), samples, train, OffloadSection(), tmp_path, progress=False,
                      callbacks=[samples.on_step])
    return trainer.fit()


def test_peek_round_is_the_next_round_and_leaves_the_state_alone():
    sampler = BucketSampler(["A", "B", "A", "B", "A"], 2, seed=3)  # 3 batches an epoch
    for _ in range(7):  # across two epoch ends
        before = copy.deepcopy(sampler.state)
        peeked = sampler.peek_round()
        assert sampler.state == before
        assert sampler.next_round() == peeked


@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_batch_is_read_while_the_round_before_computes_and_none_past_the_last_step(tmp_path, accumulation):
    torch.manual_seed(0)
    samples = WatchedSamples()
    _fit(tmp_path, samples, gradient_accumulation_steps=accumulation)
    assert len(samples.reads) == 4 * accumulation  # batch_size 1: one read a round; none for a fifth step
    # Round 0 is read when training starts; round r during round r - 1, which belongs to step
    # (r - 1) // accumulation + 1, so the steps finished then are (r - 1) // accumulation.
    expected = [0] + [(r - 1) // accumulation for r in range(1, 4 * accumulation)]
    assert [done for _, done in samples.reads] == expected


def test_same_batches_and_weights_as_reading_each_batch_when_its_round_starts(tmp_path):
    torch.manual_seed(0)
    base = ToyDiT()
    runs = {}
    for prefetch in (True, False):
        train = TrainSection(lora_rank=4, max_steps=5, save_steps=0, learning_rate=1e-2, seed=5,
                             gradient_checkpointing=False, gradient_accumulation_steps=2)
        trainer = Trainer(TOY_SPEC, copy.deepcopy(base), toy_samples(), train, OffloadSection(),
                          tmp_path / str(prefetch), progress=False)
        if not prefetch:  # the loop as it was: every batch prepared when its round starts
            trainer.next_batch.prepare_ahead = lambda batch: None
        runs[prefetch] = trainer.fit()
    assert runs[True].losses == runs[False].losses
    for (name, a), (_, b) in zip(runs[True].model.named_parameters(), runs[False].model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_batch_that_fails_to_read_stops_the_run_at_its_own_step_after_the_step_before_saved(tmp_path):
    torch.manual_seed(0)
    samples = WatchedSamples(fail_at=3)  # read 3 is step 3's batch, read during step 2
    with pytest.raises(DatasetError, match="unreadable; re-run preprocess"):
        _fit(tmp_path, samples)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert saved == ["step-00000001", "step-00000002"]  # step 2 completed and saved; step 3 never ran
