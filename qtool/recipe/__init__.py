"""Recipes: per-tensor rules (rules.py) and the TOML file they are written in (file.py, with
line numbers from tomllines.py). Torch-free, so a dry run plans from headers alone."""
