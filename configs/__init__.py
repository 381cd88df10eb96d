# Hydra configs, installed as the package `mlxlab.configs` (see pyproject.toml).
