"""Stage 1's encoding engine: encoders loaded once per process, shape-grouped batches, devices, tiling."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import diffsynth_core.models.qwen_image as qwen
from cache_store import open_cache
from stages import encoding, preprocess
from stages.config import build_config
from stages.encoder_memory import vae_tile
from tests.stages.metadata import cached_entries, rewrite_metadata

SMALL = "dataset.max_pixels=4096"  # the demo's two image sizes become 64x64 and 80x48: fast, still two shapes


def test_encoders_load_once_per_process_across_parts_and_threads(make_config):
    cfg = make_config("preprocess.parts=4", SMALL)
    encoding.release_encoders()
    before = encoding.POOL.loads
    preprocess.run(cfg, 0)
    preprocess.run(cfg, 1)
    with ThreadPoolExecutor(2) as pool:  # how the preprocess flow runs parts
        summaries = list(pool.map(lambda part: preprocess.run(cfg, part), [2, 3]))
    assert encoding.POOL.loads - before == 1
    assert sum(s.encoded for s in summaries) == 8
    assert preprocess.finalize(cfg).complete  # the parts are done: finalize gives the encoders back
    assert encoding.release_encoders() == 0


def test_batches_hold_one_shape_and_match_one_at_a_time(make_config, tmp_path):
    one = make_config(SMALL, "preprocess.decode_workers=0")
    preprocess.run(one)
    batches = []
    real = qwen.SPEC.encode_pixel_batch

    def recording(components, pixels, device):
        batches.append(tuple(pixels.shape))
        return real(components, pixels, device)

    object.__setattr__(qwen.SPEC, "encode_pixel_batch", recording)
    try:
        batched = make_config(SMALL, "preprocess.batch_size=4", "preprocess.decode_workers=2",
                              f"cache.url={tmp_path / 'batched.zarr'}")
        assert preprocess.run(batched).encoded == 16
    finally:
        object.__setattr__(qwen.SPEC, "encode_pixel_batch", real)
    assert sorted(b[0] for b in batches) == [4, 4, 4, 4] and len({b[1:] for b in batches}) == 2
    got, want = cached_entries(batched.cache_url), cached_entries(one.cache_url)
    assert got.keys() == want.keys()  # batching is not part of an entry's identity
    for key, entry in want.items():
        for name, tensor in entry.items():
            if isinstance(tensor, torch.Tensor):  # fp32 on CPU: padding and conv algorithms differ by ~1e-7
                torch.testing.assert_close(got[key][name], tensor, rtol=1e-5, atol=1e-5)
                assert got[key][name].untyped_storage().nbytes() == tensor.untyped_storage().nbytes()


def test_a_corrupt_image_stops_the_run_after_the_rows_decoded_before_it_are_written(make_config):
    import os

    cfg = make_config(SMALL, "preprocess.batch_size=8", "preprocess.commit_every=1")
    open(os.path.join(cfg.dataset.base_path, "broken.png"), "wb").write(b"not a png")
    rewrite_metadata(cfg, lambda rows: rows[:5] + [{"image": "broken.png", "prompt": "broken"}] + rows[5:])
    with pytest.raises(Exception, match="broken.png"):
        preprocess.run(cfg)  # batches of 8 were still filling when row 5 failed to decode
    assert len(open_cache(cfg.cache_url, mode="r").keys()) == 2 * 5  # the five rows before it are kept (two entries each)


def test_parts_are_spread_one_per_device():
    cfg = build_config({"preprocess": {"devices": ["cpu", "meta"], "parts": 4}})
    assert [encoding.part_device(cfg, k).type for k in range(4)] == ["cpu", "meta", "cpu", "meta"]
    assert encoding.part_device(cfg, None).type == "cpu"
    alone = build_config({"preprocess": {"device": "cpu"}})
    assert encoding.part_device(alone, 3).type == "cpu"
    if not torch.cuda.is_available():  # "all" GPUs of a machine without any: the configured device
        everything = build_config({"preprocess": {"devices": "all", "device": "cpu"}})
        assert encoding.preprocess_devices(everything) == ["cpu"]


def test_vae_tiling_follows_the_budget_and_only_tiled_rows_change_keys(make_config):
    spec = qwen.SPEC
    assert vae_tile(spec, 8.0, "auto", 1, 1328, 1328) is None           # fits 70 % of 8 GiB
    assert vae_tile(spec, 3.0, "auto", 1, 1328, 1328) == 768             # does not: largest fitting tile
    assert vae_tile(spec, 3.0, False, 1, 1328, 1328) is None
    assert vae_tile(spec, 0.0, True, 1, 1328, 1328) == 512               # forced, no budget
    assert vae_tile(spec, 0.0, True, 1, 96, 96) is None                  # nothing to cut
    assert vae_tile(spec, 0.0, True, 1, 96, 96, exact_size=False) == 512  # a bound: the setting is recorded
    plain = preprocess.make_plan(make_config())
    assert preprocess.make_plan(make_config("preprocess.vram_budget_gb=8")).keys == plain.keys
    tiled = preprocess.make_plan(make_config("preprocess.vae_tiling=true", "dataset.height=768",
                                             "dataset.width=1024"))
    assert not set(tiled.keys.values()) & set(plain.keys.values())


def test_a_budget_keeps_text_blocks_resident_only_beyond_the_activation_reserve(demo_assets):
    from stages.encoder_memory import GIB, MARGIN, place_encoders

    spec = qwen.SPEC
    reports = {}
    for budget in (0.275, 0.3):  # GiB; the VAE reserve for 64x64 fp32 samples is ~28 MB, the margin 256 MiB
        comps = spec.load_encoders(demo_assets / "model", torch.float32)
        placement = place_encoders(comps, spec, torch.device("cpu"), True, budget, "auto", (1, 64, 64), 4)
        reports[budget] = placement.report
        allowed = placement.activation_bytes_allowed
        assert allowed == max(budget * GIB - MARGIN - placement.report["resident_bytes"], 0)
        assert placement.pixels_per_call(spec, 1, 64, 64, None) == max(1, int(allowed // (2700 * 64 * 64 * 1.25 * 2)))
        lengths = [40, 90, 10, 300]
        chunks = placement.prompt_chunks(spec, lengths)
        assert [i for a, b in chunks for i in range(a, b)] == list(range(4))  # every prompt, in order, once
        for a, b in chunks:
            assert b - a == 1 or (b - a) * spec.prompt_encode_bytes(max(lengths[a:b])) * 1.25 * 2 <= allowed
        placement.close()
    assert reports[0.275]["text_blocks_resident"] == 0 and reports[0.3]["text_blocks_resident"] == 2


def test_batches_of_prompts_trade_resident_text_blocks_for_prompts_a_call():
    """FLUX.2-dev's Mistral within 8 GiB (H100 figures): 40 blocks of 1.1 GB, 3.3 GB left for blocks
    beside a 2.7 GB VAE reserve, 0.38 GB a 512-token prompt.  Three blocks resident leave room for 7
    prompts a call: 37 blocks streamed for 7 prompts (5.3 a prompt); none resident, 15 prompts a call
    share 40 blocks (2.7 a prompt).  One prompt a call keeps every block that fits."""
    from stages.encoder_memory import blocks_room

    gb = 1e9
    assert blocks_room(3.3 * gb, int(1.1 * gb), 40, 2.7 * gb, 0.38 * gb, 16) == 0
    assert blocks_room(3.3 * gb, int(1.1 * gb), 40, 2.7 * gb, 0.38 * gb, 1) == 3.3 * gb
    # prompts a call capped by the batch: 4 prompts fit beside 3 blocks already, so all 3 stay
    assert blocks_room(3.3 * gb, int(1.1 * gb), 40, 2.7 * gb, 0.38 * gb, 4) == 3.3 * gb
    # a batch of 10: 2 resident leave room for all 10 (38 blocks / 10); 3 for 7 (37 / 7); 1 or 0 stream more
    # blocks for the same 10
    assert blocks_room(3.3 * gb, int(1.1 * gb), 40, 2.7 * gb, 0.38 * gb, 10) == 2 * int(1.1 * gb)
