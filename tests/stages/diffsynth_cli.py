"""A DiffSynth-Studio command line run in this process the way `splitflow run <its flags>` runs it, without
Prefect: the flags read as the CLI reads them (``split_argv``: a ``--task`` picks the verb, ``--set`` is
splitflow's own), the checks made before anything runs, then the stages that verb runs.

The scripts' tests use it to read each script unchanged on tiny models at a few seconds a script;
tests/flows/test_diffsynth_scripts.py runs the same path through Prefect and the CLI process.
"""

from __future__ import annotations

from stages import preprocess, train
from stages.compat.diffsynth import run_config_from_cli, split_argv
from stages.config import RunConfig
from stages.precheck import check_inputs

VERB_STAGES = {"run": ("preprocess", "train"), "preprocess": ("preprocess",), "train": ("train",)}


def run_script(tokens: list[str]) -> tuple[RunConfig, dict]:
    """``tokens``: what follows ``splitflow run`` (DiffSynth's flags, ``--set KEY=VALUE`` pairs); the cwd is the
    script's.  Returns the config and each stage's summary."""
    own, flags = split_argv(["run", *tokens])
    verb = own[0]
    sets = [own[i + 1] for i, token in enumerate(own) if token == "--set"]
    stages = VERB_STAGES[verb]
    cfg = run_config_from_cli(None, sets, flags, verb)
    check_inputs(cfg, stages)
    done = {}
    if "preprocess" in stages:
        done["preprocess"] = preprocess.run(cfg)
    if "train" in stages:
        done["train"] = train.run(cfg)
    return cfg, done
