"""Kill a real `train` process with SIGKILL once it has written a checkpoint (resume tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RUN_TRAIN = """
import sys
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv.pop(1)))  # the test process's count: CPU kernels round by thread count
from stages import train
from stages.demo import demo_config
overrides = sys.argv[2:]
family = next((o.split("=", 1)[1] for o in overrides if o.startswith("model.family=")), "qwen_image")
train.run(demo_config(Path(sys.argv[1]), family, overrides))
"""


def train_until_first_checkpoint(workdir: Path, overrides: list[str], output_dir: Path) -> int:
    """Start `train` on the demo config of ``workdir`` with ``overrides``, SIGKILL it as soon as
    ``output_dir/checkpoints/latest`` exists, and return the step that checkpoint holds."""
    import torch

    threads = str(torch.get_num_threads())  # the resumed half runs in this process: both halves round alike
    proc = subprocess.Popen([sys.executable, "-c", RUN_TRAIN, threads, str(workdir), *overrides],
                            cwd=os.getcwd(), stderr=subprocess.DEVNULL)
    latest = output_dir / "checkpoints" / "latest"
    deadline = time.time() + 120
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return int(latest.read_text().strip().split("-")[1])
