"""train.optimizer names a class from an allow-list; no config can import or call anything else."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from diffsynth_core.errors import InputError
from diffsynth_core.training.optimizers import PACKAGES
from diffsynth_core.training.prepare import build_optimizer
from stages.config import ConfigError, build_config


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "subprocess.Popen", "antigravity.fly",
                                  "torch.optim.swa_utils.AveragedModel", "prodigyopt.evil"])
def test_a_name_outside_the_allow_list_is_refused_at_config_time_without_importing_it(name):
    before = set(sys.modules)
    with pytest.raises(ConfigError, match=r"train.optimizer: .*is not allowed: use a torch.optim class.*prodigyopt"):
        build_config({"train": {"optimizer": name}})
    assert not {"antigravity", "prodigyopt"} & (set(sys.modules) - before)
    with pytest.raises(InputError, match="is not allowed"):
        build_optimizer(name, _params(), 1e-3, 0.0)


def test_torch_optimizers_by_short_or_full_name_build():
    assert type(build_optimizer("SGD", _params(), 1e-3, 0.0)) is torch.optim.SGD
    assert type(build_optimizer("torch.optim.AdamW", _params(), 1e-3, 0.0)) is torch.optim.AdamW
    with pytest.raises(InputError, match="torch.optim has no optimizer 'lr_scheduler'; allowed: .*AdamW"):
        build_optimizer("torch.optim.lr_scheduler", _params(), 1e-3, 0.0)


def test_a_listed_package_that_is_not_installed_says_what_to_install():
    missing = [m for m in PACKAGES if importlib.util.find_spec(m.split(".")[0]) is None]
    if not missing:
        pytest.skip("every listed optimizer package is installed here")
    module = missing[0]
    name = f"{module}.{PACKAGES[module][0]}"
    build_config({"train": {"optimizer": name}})  # allowed by name
    with pytest.raises(InputError, match="needs the package .*pip install"):
        build_optimizer(name, _params(), 1e-3, 0.0)


def test_optimizer_args_reach_the_optimizer_and_win_over_the_host_default():
    args = build_config({}, ["train.optimizer_args.betas=[0.8, 0.95]", "train.optimizer_args.eps=1e-6",
                             "train.optimizer_args.fused=false"]).train.optimizer_args
    group = build_optimizer("AdamW", _params(), 1e-3, 0.0, on_host=True, optimizer_args=args).param_groups[0]
    assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6 and group["fused"] is False  # not the host's True
    assert build_optimizer("AdamW", _params(), 1e-3, 0.0, on_host=True).param_groups[0]["fused"] is True


@pytest.mark.parametrize("args, message", [
    ({"betaz": [0.9, 0.99]}, r"^train\.optimizer_args\.betaz: AdamW takes no 'betaz'; it takes betas, eps, .*fused$"),
    ({"betas": [1.5, 0.9]}, r"^train\.optimizer_args: AdamW refused \{'betas': \[1\.5, 0\.9\]\}: Invalid beta parameter"),
])
def test_a_misspelt_or_refused_optimizer_argument_is_one_line_naming_it(args, message):
    with pytest.raises(InputError, match=message) as caught:
        build_optimizer("AdamW", _params(), 1e-3, 0.0, optimizer_args=args)
    assert "\n" not in str(caught.value)


def test_optimizer_args_may_not_set_what_train_keys_set():
    with pytest.raises(ConfigError, match=r"train\.optimizer_args: 'lr' is set by train\.learning_rate"):
        build_config({"train": {"optimizer_args": {"lr": 1e-3}}})
    with pytest.raises(ConfigError, match=r"--set train\.lora_rank\.x: train\.lora_rank is not a table"):
        build_config({}, ["train.lora_rank.x=1"])
