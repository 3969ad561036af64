"""Recompose params.yaml from conf/ (plus optional Hydra overrides) exactly as `dvc exp run` does.

    python scripts/compose_params.py                 # the default composition
    python scripts/compose_params.py server=remote   # a different one
"""
import sys
from pathlib import Path

from dvc.utils.hydra import compose_and_dump

root = Path(__file__).resolve().parents[1]
compose_and_dump(root / "params.yaml", str(root / "conf"), None, "config", str(root), sys.argv[1:])
print(f"wrote {root / 'params.yaml'}")
