"""docs/design/concurrency-run.png: one simulated run of generation.concurrency=auto (bench/concurrency_sim.py), its
level and tok/s over time beside the best fixed levels' tok/s, on a steep knee that bends early and moves mid-run
(24 -> 48 at 40% of the run), from nothing.

    .venv/bin/python bench/concurrency_figure.py [--out docs/design/concurrency-run.png]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.concurrency_sim import Engine, simulate  # noqa: E402
from drafter_data.generation.concurrency import LevelController  # noqa: E402
from drafter_data.plots import png_figure  # noqa: E402

ENGINE = Engine(knee=24, sharpness="steep", bend=4, token_s=0.004, ttft_s=0.5, median_tokens=300, sigma=0.8,
                noise=0.1, move_at=0.4, moved_knee=48, name="steep knee 24 -> 48, bend early")
SECONDS = 600.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs/design/concurrency-run.png"))
    args = parser.parse_args()
    made = []

    def make(clock):
        made.append(LevelController.starting_at(None, 1, 256, clock=clock))
        return made[-1]

    auto = simulate(ENGINE, make, SECONDS, seed=1, every_s=5.0)
    fixed = {lv: simulate(ENGINE, lv, SECONDS, seed=1, every_s=5.0) for lv in (24, 48)}
    with png_figure(Path(args.out), size=(8, 4)) as ax:
        t = [p[0] for p in auto.series]
        ax.plot(t, [p[2] for p in auto.series], color="tab:blue", label=f"auto: {auto.whole:.0f} tok/s over the run")
        for (lv, run), color in zip(fixed.items(), ("tab:green", "tab:red")):
            ax.plot(t, [p[2] for p in run.series], color=color, alpha=0.5, lw=1,
                    label=f"fixed {lv}: {run.whole:.0f} tok/s")
        ax.axvline(ENGINE.move_at * SECONDS, color="grey", ls=":", label="the knee moves 24 -> 48")
        ax.set_xlabel("simulated seconds")
        ax.set_ylabel("output tok/s (5 s)")
        ax.legend(loc="lower right", fontsize=7)
        right = ax.twinx()
        right.step(t, [p[1] for p in auto.series], where="post", color="tab:orange")
        right.set_ylabel("auto's level (requests in flight)", color="tab:orange")
        ax.set_title("generation.concurrency=auto on a simulated steep knee that moves")
    print(f"{args.out}: auto {auto.whole:.0f} tok/s, fixed " +
          ", ".join(f"{lv} {r.whole:.0f}" for lv, r in fixed.items()))


if __name__ == "__main__":
    main()
