"""SIGTERM at random moments of `splitflow run`: how often the verb ends as documented (exit 130, one line).

``python3 -m bench.sigterm_stress --runs 30 --min-delay 0 --max-delay 4 [--busy-cores 1]``

Each run starts `splitflow run` on the demo dataset and model in a fresh output folder (so it
starts its own Prefect server), waits until that server answers, sleeps a random delay, sends
SIGTERM and waits for the verb. ``--busy-cores`` keeps cores spinning, as a loaded CI machine
would. Prints one JSON object: exit statuses counted, and each run that did not end as documented
(its delay, status and the end of its stderr).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from flows.server import PIDFILE_PREFIX, api_healthy
from stages.demo import demo_config, write_demo_dataset, write_demo_model

ROOT = Path(__file__).resolve().parents[1]
INTERRUPTED = "interrupted; work written so far is kept"


def _spin() -> None:
    while True:
        pass


def _server_url(home: Path, deadline: float) -> str:
    while time.monotonic() < deadline:
        for path in home.glob(f"{PIDFILE_PREFIX}*.json"):
            try:
                return f"http://127.0.0.1:{json.loads(path.read_text())['port']}/api"
            except ValueError:
                pass  # being written
        time.sleep(0.1)
    raise TimeoutError(f"no server pidfile in {home}")


def one_run(assets: Path, workdir: Path, delay: float) -> tuple[int, str]:
    """(exit status, stderr) of one `splitflow run` sent SIGTERM ``delay`` s after its server is healthy."""
    cfg = demo_config(workdir, overrides=[f"dataset.base_path={assets / 'dataset'}", "train.save_steps=0",
                                          f"dataset.metadata_path={assets / 'dataset' / 'metadata.csv'}",
                                          f"model.path={assets / 'model'}", "train.max_steps=400"])
    config = cfg.save(workdir / "run.toml")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    run = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config)], cwd=ROOT, text=True,
                           env={**env, "HOME": str(workdir)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = _server_url(cfg.output_dir / ".prefect", time.monotonic() + 240)
        while not api_healthy(url) and run.poll() is None:
            time.sleep(0.2)
        time.sleep(delay)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return run.returncode, err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--min-delay", type=float, default=0.0)
    parser.add_argument("--max-delay", type=float, default=4.0)
    parser.add_argument("--busy-cores", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy_cores)]
    for spinner in spinners:
        spinner.start()
    statuses, failures = Counter(), []
    try:
        with tempfile.TemporaryDirectory(prefix="sigterm-stress-") as tmp:
            assets = Path(tmp)
            write_demo_dataset(assets / "dataset")
            write_demo_model(assets / "model")
            for index in range(args.runs):
                delay = rng.uniform(args.min_delay, args.max_delay)
                status, err = one_run(assets, assets / f"run{index}", delay)
                statuses[status] += 1
                if status != 130 or INTERRUPTED not in err or "Traceback" in err:
                    failures.append({"run": index, "delay_s": round(delay, 3), "status": status,
                                     "stderr_tail": err[-600:]})
    finally:
        for spinner in spinners:
            spinner.terminate()
    print(json.dumps({"runs": args.runs, "delays_s": [args.min_delay, args.max_delay], "busy_cores": args.busy_cores,
                      "statuses": {str(k): v for k, v in sorted(statuses.items())},
                      "as_documented": args.runs - len(failures), "failures": failures}, indent=1))


if __name__ == "__main__":
    main()
