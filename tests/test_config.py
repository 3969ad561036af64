import os
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from drafter_data.config import compose
from tests.conftest import REPO


def test_params_yaml_is_the_default_composition():
    """params.yaml (what DVC tracks) must equal conf/ composed with no overrides; recompose with
    `python scripts/compose_params.py` after editing conf/."""
    committed = yaml.safe_load((REPO / "params.yaml").read_text())
    composed = OmegaConf.to_container(compose([], root=REPO), resolve=True)
    assert committed == composed


def test_groups_compose_and_override():
    cfg = compose(["target=kimi-k2.6", "server=remote", "generation.thinking=false", "prepare.sample=5"], root=REPO)
    assert cfg.target.name == "kimi-k2.6" and cfg.target.thinking_kwarg == "thinking"
    assert cfg.target.template_kwargs.preserve_thinking is True
    assert cfg.server.kind == "remote" and cfg.generation.thinking is False and cfg.prepare.sample == 5


def test_experiment_bundle_overrides_groups():
    cfg = compose(["experiment=kimi-k2.6"], root=REPO)
    assert cfg.target.name == "kimi-k2.6" and cfg.server.kind == "remote"
    assert cfg.generation.concurrency == 256 and cfg.prepare.max_prompt_tokens == 8192


def test_stage_params_declared_in_dvc_yaml_exist():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        for key in stage.get("params", []):
            node = params
            for part in str(key).split("."):
                assert part in node, f"stage {name} declares param {key}, which params.yaml lacks"
                node = node[part]


def test_each_target_sets_its_own_drift_limit_and_an_override_wins():
    """How often a model samples non-canonical splits of its own text is the target's: tokenize.max_drift_rate
    defaults to the target's figure (a tiny sampled model drifts far more than a template mismatch would allow a
    large one), and a -S/command-line tokenize.max_drift_rate still wins."""
    targets = sorted((REPO / "conf" / "target").glob("*.yaml"))
    assert len(targets) >= 3
    limits = {}
    for path in targets:
        declared = yaml.safe_load(path.read_text())["max_drift_rate"]
        assert 0 < declared < 1, path
        cfg = compose([f"target={path.stem}"], root=REPO)
        assert cfg.tokenize.max_drift_rate == declared, path.stem
        limits[path.stem] = declared
        assert compose([f"target={path.stem}", "tokenize.max_drift_rate=0.5"], root=REPO).tokenize.max_drift_rate == 0.5
    assert compose(["experiment=kimi-k2.6"], root=REPO).tokenize.max_drift_rate == limits["kimi-k2.6"]
    assert len(set(limits.values())) > 1, "every target has the same limit: it is not the target's"


BAD_VALUES = [("generation.max_tokens=0", "generation.max_tokens=0: must be 1 or more"),
              ("generation.max_tokens=-5", "generation.max_tokens=-5"),
              ("generation.temperature=-1", "generation.temperature=-1.0: must be 0.0 or more"),
              ("generation.top_p=7", "generation.top_p=7.0: must be 1.0 or less"),
              ("generation.thinking_ratio=1.5", "generation.thinking_ratio=1.5: give a share from 0 to 1"),
              ("generation.thinking_ratio=-2", "generation.thinking_ratio=-2.0: give a share from 0 to 1"),
              ("generation.top_p=nan", "generation.top_p=nan: give a number"),
              ("generation.logit_bias={106:500}", "generation.logit_bias={106: 500}: give a mapping of token id"),
              ("tokenize.max_drift_rate=null", "tokenize.max_drift_rate=<a share from 0 to 1>"),
              ("generation.max_tokens=abc", "generation.max_tokens: Value 'abc'"),
              ("generation.concurrency=many", "generation.concurrency='many'"),
              ("prepare.turns=most", "prepare.turns='most': choose one of first, last, all"),
              ("tokenize.overlength=cut", "tokenize.overlength='cut'"),
              ("+generation.temprature=0.5", "generation.temprature: unknown key"),
              ("assess.concurrency=[0,4]", "assess.concurrency=[0, 4]"),
              ("generate.max_attempts=0", "generate.max_attempts=0")]


@pytest.mark.parametrize("override,needle", BAD_VALUES)
def test_a_wrong_type_range_or_key_is_one_line_naming_it_before_any_work(run_stage, tmp_path, override, needle):
    """Every stage checks the whole config against the typed schema first (drafter_data/schema.py): no server is
    started, nothing is read or written."""
    for stage in ("generate", "prepare"):
        proc = run_stage(stage, override, f"prepare.output={tmp_path / 'p'}", f"generate.output={tmp_path / 'g'}",
                         "server.base_url=http://127.0.0.1:9/v1", check=False, timeout=60)
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        assert proc.returncode == 1 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "p").exists() and not (tmp_path / "g").exists()


@pytest.mark.parametrize("url", ["localhost:8000/v1", "[]"])
def test_a_base_url_that_is_not_a_url_is_one_line(run_stage, tmp_path, url):
    proc = run_stage("generate", "server=remote", f"server.base_url={url}", f"generate.output={tmp_path / 'g'}",
                     check=False, timeout=60)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "server.base_url=" in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "g").exists()


def stage_in(directory):
    """A stage that does nothing once its config loaded, run in `directory` (its params.yaml), as DVC runs one."""
    return subprocess.run([sys.executable, "-c", "from drafter_data.config import run_stage; run_stage(lambda c: 0)"],
                          cwd=directory, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=60)


def test_a_params_yaml_with_a_wrong_value_is_refused_in_one_line(tmp_path):
    """Under DVC a stage reads params.yaml, not conf/: the same schema applies there."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["generation"]["top_p"] = "most"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = stage_in(tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip() == \
        "error: generation.top_p: Value 'most' of type 'str' could not be converted to Float; give " \
        "generation.top_p=<a number > 0.0 and <= 1.0>"
    params["generation"]["top_p"] = 1.0
    del params["generate"]["max_failed_in_a_row"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = stage_in(tmp_path)
    assert "generate.max_failed_in_a_row is missing" in proc.stderr and "compose_params" in proc.stderr


def test_dvc_composes_with_the_schema_and_refuses_a_wrong_type_at_compose_time(tmp_path):
    """`dvc exp run -S` composes params.yaml with DVC's own Hydra call, which finds the schema through
    hydra_plugins/: a wrong type fails there, before any stage runs (scripts/compose_params.py makes that call)."""
    out = tmp_path / "params.yaml"
    code = ("import sys; from dvc.utils.hydra import compose_and_dump; "
            "compose_and_dump(sys.argv[1], sys.argv[2] + '/conf', None, 'config', sys.argv[2], sys.argv[3:])")
    ok = subprocess.run([sys.executable, "-c", code, str(out), str(REPO), "generation.max_tokens=64"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert yaml.safe_load(out.read_text())["generate"]["max_failed_in_a_row"] == 10  # the schema's keys are there
    bad = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bad.yaml"), str(REPO),
                          "generation.max_tokens=abc"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "could not be converted to Integer" in bad.stderr
    assert not (tmp_path / "bad.yaml").exists()
