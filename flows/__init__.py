"""splitflow's Prefect layer: flows, the pool coordinator and the CLI."""

import diffsynth_core  # noqa: F401  (first: it fixes MKL's thread count before torch loads)
