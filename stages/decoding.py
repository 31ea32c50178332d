"""Stage 1's input side: rows decoded in background threads, then grouped into equal-shape batches.

Decoding (Pillow, ffmpeg through imageio, the float conversion) runs in ``workers`` threads while
the encoders run on the GPU: those libraries release the GIL, and threads hand the decoded
tensors over without pickling (an 81-frame 480x832 video is 390 MB of float32).  At most
``lookahead`` rows are in flight, so host memory stays bounded whatever the dataset's size.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

from diffsynth_core.data import Sample, SampleDataset

Item = tuple[int, Sample | None]  # (row, decoded sample or None for a skipped bad row)


def decoded(dataset: SampleDataset, rows: list[int], workers: int, lookahead: int) -> Iterator[Item]:
    """``(row, dataset.load(row))`` in row order; a bad row raises when its turn comes."""
    if workers <= 0:
        for row in rows:
            yield row, dataset.load(row)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="splitflow-decode")
    try:
        todo, pending = iter(rows), deque()
        for row in todo:
            pending.append((row, pool.submit(dataset.load, row)))
            if len(pending) >= max(lookahead, 1):
                break
        while pending:
            row, future = pending.popleft()
            sample = future.result()
            for nxt in todo:  # keep the window full
                pending.append((nxt, pool.submit(dataset.load, nxt)))
                break
            yield row, sample
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def shape_batches(items: Iterable[Item], batch_size: int, max_pending: int, group=None) -> Iterator[list[Item]]:
    """Batches of up to ``batch_size`` samples of one pixel shape (and one ``group(row)`` value).

    Skipped rows come through alone.  At most ``max_pending`` samples wait in half-full buckets
    (the fullest is flushed beyond that).  If ``items`` raises, what was decoded before is still
    yielded, then the error is raised: work done before a bad row is never thrown away.
    """
    buckets: dict[tuple, list[Item]] = {}
    error = None
    try:
        for row, sample in items:
            if sample is None:
                yield [(row, None)]
                continue
            shape = (tuple(sample.pixels.shape), group(row) if group else None)
            bucket = buckets.setdefault(shape, [])
            bucket.append((row, sample))
            if len(bucket) >= batch_size:
                yield buckets.pop(shape)
            elif sum(len(b) for b in buckets.values()) > max_pending:
                yield buckets.pop(max(buckets, key=lambda s: len(buckets[s])))
    except Exception as err:  # noqa: BLE001 - re-raised below, after the decoded samples are used
        error = err
    for shape in list(buckets):
        yield buckets.pop(shape)
    if error is not None:
        raise error
