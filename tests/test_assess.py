"""The assess stage against the test server of known capacity, and the projection arithmetic."""
import json
from pathlib import Path

import pytest

from drafter_data.assessment.projection import caveat, project, what_if
from drafter_data.assessment.report import report
from stages.assess import print_projection
from tests.conftest import write_prompts


def test_the_seed_case_reads_right():
    """807.5 tok/s for 900k completions of 2,000 tokens: about 26 days."""
    p = project(807.5, 900_000, 2000)
    assert p["hours"] == pytest.approx(900_000 * 2000 / 807.5 / 3600)
    assert round(p["days"]) == 26
    assert p["tokens_storage_gb"] == pytest.approx(900_000 * 2000 * 5 / 1e9)
    rows = {r["case"]: r for r in what_if(807.5, 900_000, 2000, 0.25, completion_bytes_per_token=1.5)}
    assert rows["2x servers"]["days"] == pytest.approx(p["days"] / 2)
    assert rows["4x servers"]["days"] == pytest.approx(p["days"] / 4)
    assert rows["half the completions"]["days"] == pytest.approx(p["days"] / 2)
    assert rows["thinking off (answer tokens only, as measured)"]["days"] == pytest.approx(p["days"] / 4)
    assert rows["as measured"]["completions_storage_gb"] == pytest.approx(900_000 * 2000 * 1.5 / 1e9)


def test_a_toy_or_other_model_projection_says_it_does_not_predict_k26(capsys):
    """The embedded server (or a model that is not the target's) projects the 900k-job too: the report and the printed
    projection say plainly that those figures are not K2.6's, and what to run instead."""
    toy = caveat("local", "gemma-3-270m", "gemma3-270m")
    assert "embedded toy server's" in toy and "do not predict Kimi K2.6" in toy
    other = caveat("remote", "llama-3-8b", "kimi-k2.6")
    assert "llama-3-8b's, not the target's (kimi-k2.6)" in other and "do not predict kimi-k2.6" in other
    for text in (toy, other):
        assert "assess against your own server: python -m stages.assess experiment=kimi-k2.6 server.base_url=" in text
    assert caveat("remote", "moonshotai/Kimi-K2.6", "kimi-k2.6") is None
    assert caveat("remote", "kimi-k2.6", "kimi-k2.6") is None and caveat("remote", "gemma-3-270m", "gemma3-270m") is None

    p = project(9.0, 900_000, 2000)
    metrics = {"projection": p, "best": {"concurrency": 4, "output_tokens_per_s": 9.0}, "levels": [], "what_if": []}
    plain = report({**metrics, "caveat": None}, "kimi-k2.6", True)
    assert "Not a projection" not in plain
    warned = report({**metrics, "caveat": toy}, "gemma-3-270m", True)
    head = warned.split("Best level")[0]  # said before any figure
    assert "**Not a projection of the real job.** These figures are the embedded toy server's" in head
    print_projection(p, Path("out"), toy)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("projection: 900,000 x 2,000 tokens") and err[1] == f"NOT A PROJECTION OF THE REAL JOB: {toy}"
    print_projection(p, Path("out"), None)
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_measured_throughput_matches_what_the_server_served(run_stage, fake_server, tmp_path):
    # 4 slots x 40 tokens/s per request: the server's capacity is ~160 tok/s, reached from concurrency 4
    server = fake_server({"slots": 4, "token_delay_s": 0.025, "reasoning_words": 20, "content_words": 20})
    write_prompts(tmp_path / "prompts", 10)
    proc = run_stage("assess", "server=remote", f"server.base_url={server.url}", "server.model=fake-model",
              "target=kimi-k2.6", f"assess.input={tmp_path / 'prompts'}", f"assess.output={tmp_path / 'a'}",
              "assess.concurrency=[1,4,8]", "assess.requests_per_level=16", "generation.max_tokens=64",
              "assess.num_completions=900000", "assess.completion_tokens=2000")
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert [lv["concurrency"] for lv in metrics["levels"]] == [1, 4, 8]
    for lv in metrics["levels"]:
        w0, w1 = lv["window_unix"]
        served = server.stats(since=w0, until=w1)["tokens_in_window"] / (w1 - w0)
        assert lv["output_tokens_per_s"] == pytest.approx(served, rel=0.15), lv
        assert lv["ttft_p50_s"] is not None and lv["requests_per_s"] > 0
    one, four, eight = (lv["output_tokens_per_s"] for lv in metrics["levels"])
    assert four > 2.5 * one and eight < 1.3 * four  # the 4 slots cap throughput
    assert metrics["levels"][2]["ttft_p50_s"] > metrics["levels"][1]["ttft_p50_s"]  # requests queue beyond slots
    best = metrics["best"]
    assert best["output_tokens_per_s"] == max(one, four, eight)
    proj = metrics["projection"]
    assert proj["hours"] == pytest.approx(900_000 * 2000 / best["output_tokens_per_s"] / 3600)
    assert proj["completions_storage_gb"] > 0 and proj["storage_gb"] > proj["tokens_storage_gb"]
    text = (tmp_path / "a" / "report.md").read_text()
    assert f"{proj['days']:,.1f} days" in text
    # fake-model is not the target (kimi-k2.6): said in metrics.json, the report and the printed projection
    assert metrics["caveat"] == caveat("remote", "fake-model", "kimi-k2.6") and metrics["caveat"] in text
    assert f"NOT A PROJECTION OF THE REAL JOB: {metrics['caveat']}" in proc.stderr
    for png in ("throughput.png", "ttft.png"):
        assert (tmp_path / "a" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
