"""The row rules of the trainers that load pre-tokenized rows as they are, read in their sources.

SGLang SpecForge 0.2.0 (`specforge/data/prompt_builder.py`, `_prompt_from_record`): a row is cut to `max_length`
(`input_ids[:max_length]`, `loss_mask[:max_length]`), then dropped when its mask sums to fewer than
`min_loss_tokens`: 1 for EAGLE-3 (`specforge/algorithms/eagle3/providers.py`, `one_loss_token`), 2 for the DFlash
family (`specforge/algorithms/model_providers.py`, `dflash_min_loss_tokens`), which also passes
`loss_mask_filter=has_consecutive_supervised_tokens` (`specforge/data/loss_mask.py`: two adjacent 1s somewhere).
Each row is counted under the first rule it fails, once per family.
"""
from __future__ import annotations

import numpy as np

FAMILIES = ("eagle3", "dflash")
REASONS = {"eagle3": ("fewer_than_1_loss_token",),
           "dflash": ("fewer_than_2_loss_tokens", "no_adjacent_loss_tokens")}


def dropped_by(family: str, mask: np.ndarray) -> str | None:
    """Why `family` drops a row with this (already cut) loss mask, or None when it keeps it."""
    supervised = int(np.count_nonzero(mask))
    if family == "eagle3":
        return "fewer_than_1_loss_token" if supervised < 1 else None
    if supervised < 2:
        return "fewer_than_2_loss_tokens"
    if not bool(np.any((mask[1:] != 0) & (mask[:-1] != 0))):
        return "no_adjacent_loss_tokens"
    return None
