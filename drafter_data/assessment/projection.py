"""Time and storage of a whole generation job, projected from measured throughput."""
from __future__ import annotations

import re

TOKEN_BYTES = 5  # int32 input_id + int8 loss_mask per token, before compression


def project(tokens_per_s: float, completions: int, tokens_per_completion: float, *,
            completion_bytes_per_token: float | None = None, prompt_tokens: float = 0.0) -> dict:
    hours = completions * tokens_per_completion / tokens_per_s / 3600 if tokens_per_s > 0 else float("inf")
    out = {
        "completions": int(completions),
        "tokens_per_completion": float(tokens_per_completion),
        "output_tokens_per_s": float(tokens_per_s),
        "hours": hours,
        "days": hours / 24,
        "tokens_storage_gb": completions * (prompt_tokens + tokens_per_completion) * TOKEN_BYTES / 1e9,
    }
    if completion_bytes_per_token is not None:
        out["completions_storage_gb"] = completions * tokens_per_completion * completion_bytes_per_token / 1e9
        out["storage_gb"] = out["completions_storage_gb"] + out["tokens_storage_gb"]
    else:
        out["storage_gb"] = out["tokens_storage_gb"]
    return out


def what_if(tokens_per_s: float, completions: int, tokens_per_completion: float, answer_share: float | None,
            **kw) -> list[dict]:
    """The projection under the changes a user weighs before committing GPUs."""
    cases = [("as measured", 1, completions, tokens_per_completion),
             ("half the completions", 1, completions // 2, tokens_per_completion),
             ("answers half as long", 1, completions, tokens_per_completion / 2),
             ("2x servers", 2, completions, tokens_per_completion),
             ("4x servers", 4, completions, tokens_per_completion)]
    if answer_share:
        cases.append(("thinking off (answer tokens only, as measured)", 1, completions,
                      tokens_per_completion * answer_share))
    rows = []
    for name, servers, n, length in cases:
        p = project(tokens_per_s * servers, n, length, **kw)
        rows.append({"case": name, "servers": servers, **p})
    return rows


REAL_TARGET = "Kimi K2.6"
ASSESS_YOURS = ("to project your job, assess against your own server: python -m stages.assess experiment=kimi-k2.6 "
                "server.base_url=http://HOST:30000/v1 server.model=MODEL target.tokenizer_dir=/models/Kimi-K2.6")


def _same_model(served: str, target: str) -> bool:
    """The served model's name names the target (gemma-3-270m ~ gemma3-270m, moonshotai/Kimi-K2.6 ~ kimi-k2.6)."""
    plain = lambda name: re.sub(r"[^a-z0-9]", "", str(name).lower())  # noqa: E731
    return bool(plain(target)) and plain(target) in plain(str(served).rsplit("/", 1)[-1])


def caveat(server_kind: str, served_model: str, target: str) -> str | None:
    """What the projection is not, in one sentence, when the server measured cannot stand for the real job: the
    embedded toy server, or a model that is not the target's. None when it can."""
    if server_kind == "local":
        return (f"These figures are the embedded toy server's ({served_model} on this machine, server.kind=local): "
                f"they do not predict {REAL_TARGET} or any GPU server; {ASSESS_YOURS}")
    if not _same_model(served_model, target):
        return (f"These figures are {served_model}'s, not the target's ({target}): they do not predict {target} or "
                f"{REAL_TARGET}; {ASSESS_YOURS}")
    return None
