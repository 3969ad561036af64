"""pretokenized.jsonl as the trainers read it: SGLang SpecForge 0.2.0's own reader (`prepare_prompt_tasks` in
specforge/data/prompt_builder.py, standard library only) loads the export and yields exactly our rows, in order, and
drops from the unfiltered rows exactly what the export's summary counts for each trainer family (EAGLE-3:
min_loss_tokens=1; DFlash: min_loss_tokens=2 and `has_consecutive_supervised_tokens` from specforge/data/loss_mask.py).

SpecForge is installed from PyPI at test time (`specforge==0.2.0 --no-deps`, into a temporary directory) and its two
modules are loaded from their files: importing the `specforge` package would import torch. The file's sha256 is
pinned, so a different reader fails here instead of passing for the wrong reason.
"""
import importlib.util
import json
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import read_rows
from tests.test_export import export_overrides, lines, run
from tests.test_tokenize import completion_row, kimi_overrides, write_completions

SPECFORGE = "specforge==0.2.0"
PROMPT_BUILDER_SHA256 = "67d194fc90e0751ad13ad4f1534803004b1375f84bb7740fde13372a31a4659a"


def install(target) -> None:
    """`specforge==0.2.0 --no-deps` into target: with uv (as setup.sh installs), else pip."""
    commands = [["python3", "-m", "uv", "pip", "install", "--quiet", "--no-deps", "--target", str(target), SPECFORGE],
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), SPECFORGE],
                ["python3", "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), SPECFORGE]]
    problems = []
    for command in commands:
        if shutil.which(command[0]) is None and command[0] != sys.executable:
            continue
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode == 0 and (target / "specforge/data/prompt_builder.py").is_file():
            return
        problems.append(f"{' '.join(command[:4])}: {done.stderr.strip()[-300:]}")
    pytest.fail(f"cannot install {SPECFORGE} from PyPI: {'; '.join(problems)}")


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def specforge(tmp_path_factory):
    import hashlib

    target = tmp_path_factory.mktemp("specforge")
    install(target)
    builder = target / "specforge/data/prompt_builder.py"
    assert hashlib.sha256(builder.read_bytes()).hexdigest() == PROMPT_BUILDER_SHA256
    return (load(builder, "specforge_prompt_builder"),
            load(target / "specforge/data/loss_mask.py", "specforge_loss_mask"))


def specforge_rows(specforge, path, family: str, max_length: int) -> list[dict]:
    builder, loss_mask = specforge
    tasks = builder.prepare_prompt_tasks(
        path, None, chat_template=None, max_length=max_length, is_preformatted=False, train_only_last_turn=False,
        cache_dir=None, cache_key=None, num_proc=None, min_loss_tokens=1 if family == "eagle3" else 2,
        loss_mask_filter=None if family == "eagle3" else loss_mask.has_consecutive_supervised_tokens)
    return [task["payload"] for task in tasks]


@pytest.fixture(scope="module")
def crafted(tmp_path_factory, mlflow_uri):
    """K2.6 tokens (tokenize run once) whose loss masks are then set row by row to what each rule tests, cut at
    max_length = the shortest row - 1 (every row is cut, as the trainer cuts it)."""
    base = tmp_path_factory.mktemp("trainers")
    rows = [completion_row(f"r{i}", [{"role": "user", "content": f"Question {i}: name a colour."},
                                     {"role": "assistant", "content": f"Blue, shade {i}.", "reasoning_content": "Any."}],
                           thinking=True) for i in range(8)]
    completions = write_completions(base / "completions", rows)
    env = {"MLFLOW_TRACKING_URI": mlflow_uri}
    proc = run(kimi_overrides(completions, base / "tokens"), env, "tokenize")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shard = next((base / "tokens").glob("tokens-*.parquet"))
    table = pq.read_table(shard)
    ids = table.column("input_ids").to_pylist()
    max_length = min(map(len, ids)) - 1
    masks = []
    for k, (row_ids, mask) in enumerate(zip(ids, table.column("loss_mask").to_pylist())):
        m = np.zeros(len(row_ids), dtype=np.int8)
        if k in (0, 7):
            m[:] = mask  # the answer as tokenize masked it (its last token falls to the cut)
        elif k == 2:
            m[3] = 1  # a single supervised token
        elif k == 3:
            m[[2, 4]] = 1  # two, not adjacent
        elif k == 4:
            m[max_length:] = 1  # supervised only past the cut
        elif k == 5:
            m[max_length - 1:] = 1  # one supervised token left by the cut
        elif k == 6:
            m[[5, 6]] = 1  # two adjacent
        masks.append(m.tolist())  # k == 1: none at all
    table = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                             pa.array(masks, type=pa.list_(pa.int8())))
    pq.write_table(table, shard)
    from drafter_data.tokens.source_digest import SHARDS_KEY, shard_digests

    meta_path = base / "tokens" / "meta.json"  # crafted masks: meta.json names the shard as it now is
    meta = json.loads(meta_path.read_text())
    meta[SHARDS_KEY] = shard_digests(list((base / "tokens").glob("tokens-*.parquet")))
    meta_path.write_text(json.dumps(meta))
    unfiltered = base / "all.jsonl"
    unfiltered.write_text("".join(json.dumps({"id": f"{r['prompt_id']}#turn{r['turn']}", "input_ids": r["input_ids"],
                                              "loss_mask": r["loss_mask"]}) + "\n"
                                  for r in read_rows(base / "tokens", "tokens-")))
    return base, completions, env, max_length, unfiltered


EXPECTED = {"eagle3": {"fewer_than_1_loss_token": 2},
            "dflash": {"fewer_than_2_loss_tokens": 4, "no_adjacent_loss_tokens": 1}}


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_specforge_reads_exactly_our_rows_and_drops_what_we_counted(specforge, crafted, tmp_path, family):
    base, completions, env, max_length, unfiltered = crafted
    out = tmp_path / "export"
    proc = run(export_overrides(base / "tokens", completions, out, f"export.trainer={family}",
                                f"export.max_length={max_length}"), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in lines(out / "pretokenized.jsonl")]
    summary = json.loads((out / "summary.json").read_text())
    # SpecForge on the tokens' rows as they are: it cuts and drops; what it keeps is our file, row for row
    theirs = specforge_rows(specforge, unfiltered, family, max_length)
    assert theirs == ours
    # SpecForge on our file: nothing more to drop, nothing changed
    assert specforge_rows(specforge, out / "pretokenized.jsonl", family, max_length) == ours
    dropped = sum(1 for _ in open(unfiltered)) - len(theirs)
    assert summary["would_drop"] == EXPECTED
    assert summary["filtered"] == {f"{family}.{k}": v for k, v in EXPECTED[family].items()}
    assert dropped == sum(summary["filtered"].values()) == sum(EXPECTED[family].values())
    assert summary["rows_in"] == 8 and summary["rows_out"]["pretokenized.jsonl"] == 8 - dropped
    assert summary["truncated"] == 8 and all(len(r["input_ids"]) <= max_length for r in ours)
