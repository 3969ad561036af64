"""Checks data/export/pretokenized.jsonl with vLLM speculators' own passthrough of pre-tokenized rows (by hand: not in
CI, which does not install torch).

speculators 0.9.0's `prepare-data` passes rows that carry `input_ids` + `loss_mask` through
`_passthrough_pretokenized` (speculators/data_generation/preprocessing.py): each row cut to max_length, dropped when
it has no supervised token ("unsupervised") or fewer than minimum_valid_tokens ("filtered"), else kept as torch
tensors. Its module imports torch, datasets, transformers and huggingface_hub at the top, so this needs them:

    python -m venv /tmp/spec && /tmp/spec/bin/pip install speculators==0.9.0 \\
        --extra-index-url https://download.pytorch.org/whl/cpu
    /tmp/spec/bin/python scripts/check_speculators.py data/export/pretokenized.jsonl [--max-length 16384]

It prints how many rows speculators keeps, and fails unless it keeps every row of the export unchanged, in order (the
export already left out what an EAGLE-3 trainer drops; pass --min-valid-tokens 2 for a dflash export).
"""
from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--max-length", type=int, default=16384)
    parser.add_argument("--min-valid-tokens", type=int, default=None)
    args = parser.parse_args()
    from speculators.data_generation.preprocessing import _passthrough_pretokenized

    with open(args.path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    batch = {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows]}
    out = _passthrough_pretokenized(batch, args.max_length, args.min_valid_tokens)
    kept = [(ids.tolist(), mask.tolist()) for ids, mask in zip(out["input_ids"], out["loss_mask"])]
    ours = [(r["input_ids"][:args.max_length], r["loss_mask"][:args.max_length]) for r in rows]
    print(f"speculators _passthrough_pretokenized: {len(kept)} of {len(rows)} rows kept")
    if kept != ours:
        print("MISMATCH: speculators does not keep the export's rows as they are", file=sys.stderr)
        return 1
    print("every row kept unchanged, in order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
