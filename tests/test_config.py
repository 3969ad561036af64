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
