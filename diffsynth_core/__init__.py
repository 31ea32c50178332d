"""splitflow's engine: offload, checkpointing, data, model families and training.

Importable with torch alone; never imports Prefect, zarr or the upper packages.
"""
