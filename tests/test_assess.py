"""The assess stage against the test server of known capacity, and the projection arithmetic."""
import json

import pytest

from drafter_data.assessment.projection import project, what_if
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


def test_measured_throughput_matches_what_the_server_served(run_stage, fake_server, tmp_path):
    # 4 slots x 40 tokens/s per request: the server's capacity is ~160 tok/s, reached from concurrency 4
    server = fake_server({"slots": 4, "token_delay_s": 0.025, "reasoning_words": 20, "content_words": 20})
    write_prompts(tmp_path / "prompts", 10)
    run_stage("assess", "server=remote", f"server.base_url={server.url}", "server.model=fake-model",
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
    report = (tmp_path / "a" / "report.md").read_text()
    assert f"{proj['days']:,.1f} days" in report
    for png in ("throughput.png", "ttft.png"):
        assert (tmp_path / "a" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
