"""Beyond one machine, simulated on this one: preprocess parts run by separate processes writing one
s3:// cache (moto's real server), then two ``torchrun --nnodes 2`` "nodes" train from it
(offloaded, sharing one host copy of the frozen weights, since both "nodes" are this machine)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages import preprocess, train
from tests.cache_store.conftest import s3_server  # noqa: F401 - moto's server, as a fixture

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_s3(cfg, options):
    return cfg.model_copy(update={"cache": cfg.cache.model_copy(update={"storage_options": options})})


def _bucket(options) -> str:
    import boto3

    name = f"scale-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1",
                 endpoint_url=options["client_kwargs"]["endpoint_url"]).create_bucket(Bucket=name)
    return name


def _run_all(commands: list[list[str]], timeout: float = 240) -> list[str]:
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in commands]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # never leave a worker behind, even when one failed or hung
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


def test_worker_processes_fill_one_s3_cache_and_two_torchrun_nodes_train_from_it(make_config, s3_server, tmp_path):
    url = f"s3://{_bucket(s3_server)}/cache.zarr"
    steps = ["dataset.max_pixels=4096", "train.max_steps=3", "train.save_steps=0", "train.max_grad_norm=0.5",
             f"cache.url={url}", "offload.enable_model_cpu_offload=true"]
    cfg = _with_s3(make_config(*steps, "preprocess.parts=2", f"output.path={tmp_path / 'nodes'}"), s3_server)
    config_path = cfg.save(tmp_path / "run.toml")

    # two preprocessing "machines" at once, one part each, one shared cache: a worker process, and this one
    with ThreadPoolExecutor(1) as pool:
        here = pool.submit(preprocess.run, cfg, 1)
        [out] = _run_all([[sys.executable, "-m", "flows.cli", "preprocess", str(config_path), "--part", "0"]])
        encoded = [int(re.search(r"(\d+) encoded", out).group(1)), here.result().encoded]
    assert encoded == [8, 8]  # every entry encoded once, by exactly one worker
    assert preprocess.finalize(cfg).complete

    # two training "nodes" of one rank each, reading the cache from s3
    port = str(_free_port())
    _run_all([[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", port,
               "-m", "flows.cli", "train", str(config_path), "--in-process"] for k in range(2)])

    single = _with_s3(make_config(*steps, "train.gradient_accumulation_steps=2", f"output.path={tmp_path / 'one'}"),
                      s3_server)
    train.run(single)  # one process accumulating the two nodes' samples
    got = load_file(str(cfg.output_dir / "lora.safetensors"))
    expected = load_file(str(single.output_dir / "lora.safetensors"))
    assert got.keys() == expected.keys()
    for key in expected:  # all-reduce sums in another order than accumulation: equal up to rounding
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6)
