"""Registers drafter-data's config schema in Hydra's ConfigStore when `dvc exp run` composes params.yaml: DVC lets
Hydra scan the repo root (its hydra.plugins_path) for this namespace package, and Hydra imports every module in it."""
from drafter_data.schema import register

register()
