from pathlib import Path

import pytest

from diffsynth_core.models import known_families
from stages.config import load_config

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))


def test_there_are_shipped_examples():
    assert {p.stem for p in EXAMPLES} >= {"tiny_demo", "qwen_image_lora", "flux_lora", "wan_lora"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_names_a_known_family(path):
    cfg = load_config(path)
    assert cfg.model.family in known_families()
