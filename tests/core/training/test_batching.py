"""Bucketed batches: which samples batch together, in what order, and how their tensors are stacked."""

from collections import Counter
from dataclasses import replace

import pytest
import torch

from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family
from diffsynth_core.training.batching import latent_shapes, stack_entries, to_device
from diffsynth_core.training.loop import Trainer
from diffsynth_core.training.sampler import BucketSampler, SamplerState
from stages.config import OffloadSection, TrainSection

from .toy import TOY_PADDED_SPEC, ToyDiT, mixed_toy_samples

# 7 samples in buckets A (4 samples) and B (3 samples)
BUCKETS = ["A", "B", "A", "B", "A", "B", "A"]


def _epoch(sampler):
    return [batch for _ in range(sampler.rounds_per_epoch) for batch in sampler.next_round()]


@pytest.mark.parametrize("drop_last, sizes", [(False, [1, 2, 2, 2]), (True, [2, 2, 2])])
def test_batches_hold_one_bucket_and_the_short_last_batch_is_kept_or_dropped(drop_last, sizes):
    sampler = BucketSampler(BUCKETS, batch_size=2, drop_last=drop_last, repeat=2, seed=3)
    batches = _epoch(sampler)  # repeat 2: A has 8 samples (4 batches of 2), B has 6 (3 batches)
    assert all(len({BUCKETS[i] for i in b.indices}) == 1 and BUCKETS[b.indices[0]] == b.bucket for b in batches)
    assert Counter(i for b in batches for i in b.indices) == Counter({i: 2 for i in range(7)})  # repeat x each
    four = BucketSampler(BUCKETS, batch_size=4, drop_last=drop_last, repeat=2, seed=3)
    by_bucket = sorted((b.bucket, len(b.indices)) for b in _epoch(four))
    assert by_bucket == sorted([("A", 4), ("A", 4), ("B", 4)] + ([] if drop_last else [("B", 2)]))
    assert ("last batch of 2 " + ("dropped" if drop_last else "trained")) in four.describe()
    assert sorted(len(b.indices) for b in _epoch(BucketSampler(BUCKETS, 2, drop_last, 1, 3))) == sizes


def test_order_is_a_function_of_the_seed_and_resumes_from_its_state():
    run = lambda seed: [b.indices for b in _epoch(BucketSampler(BUCKETS, 2, seed=seed))]
    assert run(5) == run(5) and run(5) != run(6)
    straight = BucketSampler(BUCKETS, 2, seed=5)
    rounds = [straight.next_round() for _ in range(7)]  # crosses into epoch 1 (4 batches per epoch)
    resumed = BucketSampler(BUCKETS, 2, seed=5)
    resumed.state = SamplerState(1, 0)
    assert [resumed.next_round() for _ in range(3)] == rounds[4:]
    serials = [s for r in rounds for b in r for s in b.serials]
    assert len(set(serials)) == len(serials)  # every draw has its own noise


def test_ranks_get_whole_batches_of_the_single_process_order():
    one = BucketSampler(BUCKETS, 2, seed=1)
    single = [b for _ in range(4) for b in one.next_round()]
    ranks = [BucketSampler(BUCKETS, 2, seed=1, rank=r, world_size=2) for r in range(2)]
    rounds = [ranks[0].next_round(), ranks[0].next_round()]
    assert [b for r in rounds for b in r] == single[:4]  # the same batches, serials included
    assert [ranks[1].next_round(), ranks[1].next_round()] == rounds and ranks[0].state == ranks[1].state
    with pytest.raises(InputError, match="drop_last"):
        BucketSampler(["A", "B"], batch_size=4, drop_last=True)
    with pytest.raises(InputError, match="3 ranks"):
        BucketSampler(["A", "B"], batch_size=4, world_size=3)


def collate(entries, padding, device, dtype):
    """What the trainer does with a batch, in one call: stack on the host, then move and cast."""
    return to_device(stack_entries(entries, padding), device, dtype)


def test_collate_pads_prompts_with_their_mask_and_refuses_unpadded_ragged_tensors():
    samples = mixed_toy_samples(5)[::2]  # one latent shape; prompts of 2, 4 and 3 tokens
    batch = collate(samples, {"prompt_embeds": "prompt_mask"}, torch.device("cpu"), torch.bfloat16)
    assert batch["prompt_embeds"].shape == (3, 4, 4) and batch["prompt_embeds"].dtype == torch.bfloat16
    assert batch["latents"].shape == (3, 4, 4, 4) and batch["prompt_mask"].dtype == torch.long
    assert batch["prompt_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["prompt_embeds"][0, 2:].abs().sum() == 0 and "meta" not in batch
    with pytest.raises(InputError, match="prompt_embeds"):
        collate(samples[:2], {}, torch.device("cpu"), torch.float32)
    unmasked = [{k: v for k, v in s.items() if k != "prompt_mask"} for s in samples]  # zeros would read as tokens
    with pytest.raises(InputError, match="different 'prompt_embeds' lengths hold no 'prompt_mask'"):
        collate(unmasked, {"prompt_embeds": "prompt_mask"}, torch.device("cpu"), torch.float32)
    assert latent_shapes(mixed_toy_samples(3)) == [(4, 4, 4), (4, 4, 6), (4, 4, 4)]


def test_qwen_image_batch_of_padded_prompts_predicts_what_each_sample_does_alone():
    """The mask makes padding invisible: a batch of two prompts of different lengths gives each sample's
    own prediction (Qwen-Image's encoder output varies in length; FLUX/Wan pad to a fixed length)."""
    spec = get_family("qwen_image")
    model = spec.build_transformer("tiny", torch.float32, "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights large enough that attending to padding would show (it does: ~1.2 vs 1e-5)
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    entries = []
    for seed, length in ((0, 5), (1, 9)):
        latents, cond = spec.dummy_inputs(model.config, batch=1, height=64, width=64, text_len=length, seed=seed)
        entries.append({"latents": latents[0], **{k: v[0] for k, v in cond.items()}})
    sigmas = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        batch = collate(entries, spec.batch_padding, torch.device("cpu"), torch.float32)
        together = spec.dit_forward(model, batch.pop("latents"), sigmas, batch)
        for i, entry in enumerate(entries):
            alone = collate([entry], spec.batch_padding, torch.device("cpu"), torch.float32)
            own = spec.dit_forward(model, alone.pop("latents"), sigmas[i: i + 1], alone)
            torch.testing.assert_close(together[i: i + 1], own, rtol=1e-4, atol=1e-4)


def test_caption_dropout_replaces_about_p_of_the_prompts_by_the_empty_one(tmp_path):
    seen = []

    def recording_forward(model, latents, sigmas, cond):
        seen.extend(bool((row == -7).all()) for row in cond["prompt_embeds"][:, 0])  # the empty prompt's marker
        return TOY_PADDED_SPEC.dit_forward(model, latents, sigmas, cond)

    spec = replace(TOY_PADDED_SPEC, dit_forward=recording_forward)
    empty = {"prompt_embeds": torch.full((1, 4), -7.0), "prompt_mask": torch.ones(1, dtype=torch.long)}
    train = TrainSection(lora_rank=2, max_steps=50, batch_size=8, caption_dropout=0.25, seed=2,
                         gradient_checkpointing=False, save_steps=0)
    Trainer(spec, ToyDiT(), mixed_toy_samples(16), train, OffloadSection(), tmp_path, progress=False,
            empty_prompt=empty).fit()
    assert len(seen) == 400 and 0.19 < sum(seen) / 400 < 0.31  # binomial(400, 0.25): sd 0.022
    with pytest.raises(InputError, match="empty prompt"):
        Trainer(spec, ToyDiT(), mixed_toy_samples(8), train, OffloadSection(), tmp_path / "x", progress=False)
