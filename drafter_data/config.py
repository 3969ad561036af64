"""Where a stage's configuration comes from: params.yaml (under DVC), or conf/ plus overrides (by hand)."""
from __future__ import annotations

import atexit
import errno
import os
import signal
import sys
import threading
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from drafter_data import schema
from drafter_data.errors import StageError

CONFIG_NAME = "config"


def compose(overrides: list[str], root: Path | None = None) -> DictConfig:
    """conf/ plus Hydra overrides, resolved, as `dvc exp run` composes params.yaml."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    schema.register()
    conf_dir = (root or Path.cwd()) / "conf"
    with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base=None):
        cfg = hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


def load(argv: list[str] | None = None) -> DictConfig:
    """With no overrides: params.yaml in the cwd (what DVC tracks). With overrides: conf/ + overrides. Either way
    typed and range-checked (drafter_data/schema.py) before a stage does any work."""
    overrides = sys.argv[1:] if argv is None else argv
    if overrides:
        if (hint := schema.renamed_override(overrides)) is not None:
            raise StageError(hint)
        try:
            cfg = compose(overrides)
        except Exception as exc:  # hydra's own messages are good; keep them on one line
            raise StageError(f"cannot compose conf/ with {overrides}: {schema.one_line(exc)}") from exc
    else:
        params = Path("params.yaml")
        if not params.exists():
            raise StageError(f"no params.yaml in {Path.cwd()}; run from the repo root or pass overrides")
        try:
            plain = OmegaConf.load(params)
        except Exception as exc:  # noqa: BLE001 - a broken YAML file: one line
            raise StageError(f"cannot read {params.resolve()}: {schema.one_line(exc)}") from None
        cfg = schema.typed(plain)
    schema.check(cfg)
    return cfg


def flatten(cfg: DictConfig | dict, prefix: str = "") -> dict[str, object]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay whole (as their string form)."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    flat: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_stage(main) -> None:
    """Entry point shared by the stages: config in, one-line reason and exit 1 on StageError. SIGTERM unwinds like
    Ctrl-C (outside generate's run loop, which handles it itself), so what a stage started, e.g. its llama-server, is
    stopped."""
    signal.signal(signal.SIGTERM, _terminated)
    try:
        cfg = load()
        code = main(cfg)
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    except OSError as exc:  # a full disk, a permission, a file gone: the system's words and what to do, one line
        print(f"error: {os_error_line(exc)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        code = 130
    exit_without_teardown(code or 0)


OS_ERROR_HINTS = {errno.ENOSPC: "free some space, then run the stage again (what is complete is kept)",
                  errno.EDQUOT: "free some space, then run the stage again (what is complete is kept)",
                  errno.EACCES: "check the permissions of that path", errno.EPERM: "check the permissions of that path",
                  errno.EROFS: "that filesystem is read-only: choose another output",
                  errno.ENOENT: "the file or directory is not there: check the path"}


def os_error_line(exc: OSError) -> str:
    """An OSError as one line: what failed, on which path, and what to do."""
    what = exc.strerror or str(exc) or type(exc).__name__
    where = " ".join(f"'{f}'" for f in (exc.filename, exc.filename2) if f)
    hint = OS_ERROR_HINTS.get(exc.errno)
    return " ".join(f"{what}{': ' + where if where else ''}{'; ' + hint if hint else ''}".split())


def exit_without_teardown(code: int) -> None:
    """Exits as the interpreter would (other threads finished, exit handlers run, streams flushed) but skips its
    teardown, which collects every object of every module loaded (mlflow, pyarrow, pandas: ~0.8 s, measured)."""
    threading._shutdown()  # what the interpreter does first: wakes idle executor threads, joins non-daemon ones
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)
