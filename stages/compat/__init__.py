"""Inputs from other tools, translated into a ``RunConfig`` in one place.

Each module here reads one foreign format (DiffSynth-Studio command lines and model references,
musubi-tuner dataset TOML/JSONL, kohya-style caption folders) and returns config data or a
``RunConfig``; nothing downstream knows where a config came from.
"""
