"""splitflow's engine: offload, checkpointing, data, model families and training.

Importable with torch alone; never imports Prefect, zarr or the upper packages.
"""

import os

# MKL picks its thread count per call when dynamic (its default), and under CPU load it picks fewer: the same
# fp32 step then rounds otherwise, and a CPU run resumed in another process no longer ends bit for bit where an
# uninterrupted one would.  Read once, when torch loads MKL, so it is set here, before any torch import of ours
# (flows/ and stages/ import this package first); a user's own MKL_DYNAMIC wins.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
