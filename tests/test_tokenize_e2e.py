"""generate -> tokenize against the fake server answering in Kimi K2.6 token ids (vLLM's and llama-server's
shapes), some rows with one token sampled as a non-canonical split: the tokens rows carry exactly the server's ids,
and drift counts exactly the split rows."""
import json
import urllib.request

import pytest

from tests.conftest import KIMI_DIR, read_rows, write_prompts

IM_END = 163586


@pytest.mark.parametrize("engine", ["vllm", "llama"])
def test_server_ids_through_generate_and_tokenize(run_stage, fake_server, tmp_path, engine):
    write_prompts(tmp_path / "in", 12)
    server = fake_server({"token_ids": engine, "engine": engine, "split_token_every": 3, "reasoning_words": 8,
                          "content_words": 8})
    kimi = ["target=kimi-k2.6", f"target.tokenizer_dir={KIMI_DIR}"]
    run_stage("generate", "server=remote", f"server.base_url={server.url}", "server.model=fake-model", *kimi,
              f"generate.input={tmp_path / 'in'}", f"generate.output={tmp_path / 'c'}")
    completions = {r["prompt_id"]: r for r in read_rows(tmp_path / "c", "completions-")}
    assert len(completions) == 12 and all(r["completion_token_ids"] for r in completions.values())
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/split", timeout=10) as resp:
        split = json.loads(resp.read())["count"]
    assert 0 < split < 12
    run_stage("tokenize", *kimi, f"tokenize.input={tmp_path / 'c'}", f"tokenize.output={tmp_path / 't'}",
              "tokenize.max_drift_rate=1")
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    assert meta["drift"]["rows_compared"] == 12 and meta["drift"]["rows_differ"] == split
    for row in read_rows(tmp_path / "t"):
        done = completions[row["prompt_id"]]
        start = row["loss_mask"].index(1)
        answer = done["completion_token_ids"]
        answer = answer if answer[-1] == IM_END else answer + [IM_END]
        assert row["input_ids"][start:] == answer and set(row["loss_mask"][start:]) == {1}
        if done["prompt_token_ids"] is not None:
            assert row["input_ids"][:start] == done["prompt_token_ids"]
    assert meta["prompt_ids"]["rows_differ"] == 0
