"""splitflow's stages: preprocess and train as plain functions over a RunConfig."""

import diffsynth_core  # noqa: F401  (first: it fixes MKL's thread count before torch loads)
