"""The training steps run with the heap alive at their start hidden from Python's cyclic collector
(collector.py: a full collection over it stalled H200 steps by up to 0.25 s)."""
import gc
import weakref

import pytest

from diffsynth_core.training.collector import frozen_heap
from diffsynth_core.training.loop import Trainer
from stages.config import OffloadSection, TrainSection

from .toy import TOY_SPEC, ToyDiT, toy_samples


class _Node:
    pass


def test_the_block_hides_the_old_heap_collects_new_cycles_and_unfreezes_on_error():
    with pytest.raises(RuntimeError):
        with frozen_heap():
            assert gc.get_freeze_count() > 1000  # torch and this test's imports
            cycle = _Node()
            cycle.me = cycle
            gone = weakref.ref(cycle)
            del cycle
            gc.collect()
            assert gone() is None  # a cycle the steps make is still collected
            raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0


def test_fit_runs_its_steps_under_a_frozen_heap(tmp_path):
    seen = []
    train = TrainSection(lora_rank=4, max_steps=2, save_steps=0, seed=1, gradient_checkpointing=False)
    trainer = Trainer(TOY_SPEC, ToyDiT(), toy_samples(), train, OffloadSection(), tmp_path, progress=False,
                      callbacks=[lambda step, model: seen.append(gc.get_freeze_count())])
    trainer.fit()
    assert len(seen) == 2 and min(seen) > 1000
    assert gc.get_freeze_count() == 0
