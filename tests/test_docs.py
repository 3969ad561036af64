"""The documentation: README short, paragraphs readable, the site's tables taken from the code, and the Getting
started commands run as written."""
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

DOCS = sorted((REPO / "docs").rglob("*.md"))


def paragraphs(text: str):
    """(first line number, lines) of each paragraph: prose lines in a row, outside code blocks and tables; a list
    item starts a new one."""
    current, start, fenced = [], 0, False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
        new_item = re.match(r"\s*([-*]|\d+\.) ", line) is not None
        if fenced or not stripped or stripped.startswith(("|", "#", "<!--", "```")) or new_item:
            if current:
                yield start, current
            current = [line] if new_item and not fenced else []
            start = number
            continue
        if not current:
            start = number
        current.append(line)
    if current:
        yield start, current


def test_the_readme_is_what_a_user_does_first():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for needle in ("./setup.sh && . .venv/bin/activate && dvc repro", "python -m pytest", "experiment=kimi-k2.6",
                   "docs/"):
        assert needle in text, needle
    ci = (REPO / ".ci/run").read_text().strip().splitlines()[-1]
    assert ci in text, "the README's test command is not .ci/run's"


@pytest.mark.parametrize("path", [REPO / "README.md", *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_no_paragraph_is_longer_than_twelve_lines(path):
    long = [(start, len(lines)) for start, lines in paragraphs(path.read_text()) if len(lines) > 12]
    assert not long, f"{path.name}: paragraphs of more than 12 lines at (line, length) {long}"


def test_every_config_section_has_its_generated_table_in_the_docs():
    from dataclasses import fields

    from drafter_data.schema import Config
    from scripts.mkdocs_hooks import config_rows

    text = "\n".join(p.read_text() for p in DOCS)
    for section in (f.name for f in fields(Config)):
        assert f"<!-- config: {section} -->" in text, f"no config table for {section}"
        keys = [row[0] for row in config_rows(section)]
        assert keys and all(k.startswith(section + ".") for k in keys)


def test_the_troubleshooting_table_lists_every_error_a_stage_can_stop_with():
    """Every StageError(...) / self.fail(...) in the code with a message written there is in the generated table:
    counted independently of the hook's own walk, by the source text."""
    from scripts.mkdocs_hooks import error_messages, errors_table

    assert "<!-- errors -->" in (REPO / "docs/guides/long-runs.md").read_text()
    found = error_messages()
    table = errors_table()
    by_text = 0
    for path in [*REPO.glob("stages/*.py"), *REPO.glob("drafter_data/**/*.py")]:
        source = path.read_text()
        by_text += len(re.findall(r"(?:StageError|self\.fail)\(\s*f?\"", source))
    assert len(found) == by_text > 40
    for _, message in found:
        assert message.replace("|", "&#124;") in table


def test_the_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "site" / "stages" / "generate" / "index.html").read_text()
    assert "generation.history_reasoning" in page and "<!-- config" not in page


def bash_blocks(path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.timeout(2400)
def test_the_getting_started_commands_run_as_written(tmp_path, fake_server):
    """Each command of docs/getting-started.md, in order, in a fresh clone: the embedded default end to end, then
    K2.6 against a test server that serves K2.6's own token ids (its URL, the tokenizer files and a prompt file put
    in for the page's placeholders), then back to the default."""
    import json
    import os

    import pyarrow.parquet as pq

    from tests.conftest import KIMI_DIR

    clone = tmp_path / "drafter-data"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    server = fake_server({"models": ["kimi-k2.6"], "token_ids": "vllm", "engine": "vllm", "api_key": "sk-your-key",
                          "check_model": True})
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(REPO)))
    # the user's prompt file: plain questions. The test server renders tool declarations as JSON, not as K2.6's
    # TypeScript-style tools_ts_str, so its prompt ids for prompts with tools are not K2.6's (ours are, checked
    # against tools_golden.jsonl): tokenize would rightly count them as prompt mismatches
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} times {i + 3}?"}) + "\n"
                               for i in range(24)))
    blocks = bash_blocks(REPO / "docs/getting-started.md")
    assert len(blocks) == 5

    exported: list[str] = []  # a reader's shell keeps what an earlier block exported

    def run(block: str) -> str:
        script = "\n".join([*exported, block])
        exported.extend(line for line in block.splitlines() if line.startswith("export "))
        script = (script.replace("http://GPU-NODE:30000/v1", server.url).replace("/models/Kimi-K2.6", str(KIMI_DIR))
                  .replace("/data/prompts.jsonl", str(prompts)))
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", ". .venv/bin/activate 2>/dev/null || true\n" + script],
                              cwd=clone, env=env, capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, f"{script}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    run(blocks[0])
    meta = json.loads((clone / "data/tokens/meta.json").read_text())
    assert meta["rows"]["kept"] == 54
    assert "completions" in run(blocks[1]).lower()
    assert "kimi-k2.6" in run(blocks[2]) and (clone / "data/assessment/report.md").exists()
    run(blocks[3])
    rows = [r for shard in sorted((clone / "data/completions").glob("completions-*.parquet"))
            for r in pq.read_table(shard).to_pylist()]
    assert rows and {r["target"] for r in rows} == {"kimi-k2.6"} and all(r["completion_token_ids"] for r in rows)
    assert json.loads((clone / "data/tokens/meta.json").read_text())["target"] == "kimi-k2.6"
    run(blocks[4])
    committed = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=clone, capture_output=True, text=True).stdout
    assert (clone / "params.yaml").read_text() == committed
