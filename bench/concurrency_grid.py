"""generation.concurrency=auto over a family of simulated servers (bench/concurrency_sim.py), not one.

Each grid point is an engine: knee position (4-256), sharpness (plateau / gentle / steep), diminishing returns from
the start (bend early or late), answer lengths (50-4,000 tokens, long-tailed, short or long median), time to first
token (0-3 s), noise (5% or 25%), and a knee that stays, doubles or halves mid-run (at 35% of the run); auto starts
from nothing or from a misleading assessment. On each, auto and fixed levels beside it (a 2^(1/2) ladder around the
knee, the knee and the moved knee) run the same simulated time (about 80 request lifetimes); the figures are auto's
tok/s over the whole run and over its second half (steady) against the best fixed level of each, measured in the same
run (with several seeds, the level best on their mean: not the luckiest run of one). The worst point is printed
first. The points are drawn by GRID_SEED; HELD_OUT_SEED chose, before any tuning, the points kept out of it (marked
`held-out`, reported separately; docs/design/concurrency.md lists them). The issue's steep server (64 slots,
(active/24)^2 past 24, 200-400 tokens, tok/s bending early) is point 0, over 45 s from nothing.

`--controller gradient|aimd|bandit|paired|hybrid` runs bench/concurrency_alternatives.py's alternatives (same grid).
`--floor` runs the benchmark's own floor as well: the reference level itself from the start (an oracle that knows it),
on other luck (seed + 1000, or --floor-offset), against the same reference; its misses are the grid's own noise.
`--unstreamed` tells auto of each answer only when it ends (generate.stream=false, or a token-id method that cannot
stream, such as llama-server's). `--no-drift` turns off the whole engine's slow drift (each sequence's speed still
varies): how much of the miss the drift is. `--common-luck` pairs the comparison: in one seed auto and every fixed
level meet the same drift path and the same n-th answer (bench/concurrency_sim.py's common_luck), so the figures
measure the search, not which run was luckier.

    python bench/concurrency_grid.py [--seeds 1] [--worst 6] [--jobs 2] [--controller bracket|...|hybrid]
                                     [--unstreamed] [--no-drift] [--floor [--floor-offset 1000]]
                                     [--common-luck]
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import replace
from multiprocessing import Pool
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.concurrency_sim import Engine, run_length, simulate  # noqa: E402
from drafter_data.generation.concurrency import LevelController  # noqa: E402

GRID_SEED, HELD_OUT_SEED, POINTS, HELD_OUT = 2026, 30, 36, 8
STEEP = Engine(knee=24, sharpness="steep", bend=3.8, token_s=0.000542, median_tokens=300, sigma=0.2, min_tokens=200,
               max_tokens=400, slots=64, name="issue's steep server (45 s)")


def grid() -> list[tuple[Engine, int | None, float]]:
    """(engine, auto's start level or None, run seconds) per point; point 0 is the issue's steep server."""
    rng = random.Random(GRID_SEED)
    points = [(STEEP, None, 45.0)]
    for i in range(POINTS):
        knee = rng.choice([4, 6, 12, 24, 40, 64, 100, 160, 256])
        sharp = ["plateau", "gentle", "steep"][i % 3]
        bend = knee / 6 if rng.random() < 0.5 else 4 * knee
        median = rng.choice([120, 400, 1000])
        ttft = rng.choice([0.0, 0.3, 1.0, 3.0])
        noise = rng.choice([0.05, 0.25])
        move = rng.choice([None, None, 2.0, 0.5])
        start = rng.choice([None, None, max(1, knee // 4), min(256, knee * 4)])
        moved = None if move is None else max(2, min(256, round(knee * move)))
        name = (f"knee {knee}{'->' + str(moved) if moved else ''} {sharp} bend {'early' if bend < knee else 'late'} "
                f"{median} tok ttft {ttft:g} noise {noise:g} start {start or '-'}")
        engine = Engine(knee=knee, sharpness=sharp, bend=bend, token_s=0.02 / math.sqrt(knee), ttft_s=ttft,
                        median_tokens=median, sigma=1.0, noise=noise, move_at=0.35 if moved else None,
                        moved_knee=moved, name=name)
        points.append((engine, start, run_length(engine)))
    return points


def held_out() -> set[int]:
    return set(random.Random(HELD_OUT_SEED).sample(range(1, POINTS + 1), HELD_OUT))


def fixed_levels(engine: Engine) -> list[int]:
    knees = [engine.knee] + ([engine.moved_knee] if engine.moved_knee else [])
    ladder = {round(k * 2 ** (j / 2)) for k in knees for j in range(-4, 5)}
    return sorted({min(256, max(1, lv)) for lv in ladder})


def run_point(args) -> dict:
    index, (engine, start, seconds), seed, kind, streamed, common = args
    steps = int(min(12000, max(2000, seconds / 0.02)))
    fixed = {lv: simulate(engine, lv, seconds, seed, steps=steps, common_luck=common) for lv in fixed_levels(engine)}

    def make(clock):
        if kind == "bracket":
            return LevelController.starting_at(start, 1, 256, clock=clock)
        from bench.concurrency_alternatives import (AimdLimiter, BanditController, GradientLimiter, HybridController,
                                                    PairedController)

        if kind in ("bandit", "paired", "hybrid"):
            cls = {"bandit": BanditController, "paired": PairedController, "hybrid": HybridController}[kind]
            return cls.starting_at(start, 1, 256, clock=clock)
        return {"gradient": GradientLimiter, "aimd": AimdLimiter}[kind](level=start or 4, low=1, high=256, clock=clock)

    auto = simulate(engine, make, seconds, seed, steps=steps, streamed=streamed, common_luck=common)
    return {"index": index, "name": engine.name, "seed": seed, "seconds": seconds,
            "auto": {"whole": auto.whole, "steady": auto.steady},
            "fixed": {lv: {"whole": r.whole, "steady": r.steady} for lv, r in fixed.items()}}


def against_best_level(rows: list[dict]) -> list[dict]:
    """Auto's figures over the best fixed level's, measured in the same run. The best level has the highest mean over
    the point's runs (seeds): one run's best fixed run is partly that run's luck (on a plateau, where levels tie, the
    luckiest of a dozen), a level no one could have picked beforehand. With one run a point, it is that run's best.
    `whole_run_best` and `steady_run_best` keep the figures against each run's own best fixed run."""
    for r in rows:
        runs = [o for o in rows if o["index"] == r["index"]]
        for k in ("whole", "steady"):
            level = max(r["fixed"], key=lambda lv: sum(o["fixed"][lv][k] for o in runs))
            r[k], r[f"best_{k}"] = r["auto"][k] / r["fixed"][level][k], level
            r[f"{k}_run_best"] = r["auto"][k] / max(f[k] for f in r["fixed"].values())
    return rows


def run_floor(args) -> dict:
    """The reference levels of one run, held from the start on other luck: what a controller that knew them reads."""
    r, (engine, _, seconds), offset, common = args
    steps = int(min(12000, max(2000, seconds / 0.02)))
    again = {lv: simulate(engine, lv, seconds, offset + r["seed"], steps=steps, every_s=1.0, common_luck=common)
             for lv in {r["best_whole"], r["best_steady"]}}
    rates = [rate for t, _, rate in again[r["best_steady"]].series if t > seconds / 2]
    spread = {}
    for w in (3, 30):
        logs = [math.log(max(sum(rates[i:i + w]) / w, 1e-9)) for i in range(0, len(rates) - w + 1, w)]
        spread[w] = statistics.pstdev(logs) if len(logs) > 1 else math.nan
    ratios = {k: getattr(again[r[f"best_{k}"]], k) / r["fixed"][r[f"best_{k}"]][k] for k in ("whole", "steady")}
    return {**r, **ratios, "spread": spread}


def span(rows: list[dict], window: int) -> str:
    values = [r["spread"][window] for r in rows if not math.isnan(r["spread"][window])]
    return f"{min(values):.2f}-{max(values):.2f}" if values else "n/a"


def shortfall(r: dict, against: str = "") -> float:
    """How far below its goal a point is: < 1 misses whole >= 0.9 or steady >= 0.95."""
    return min(r["whole" + against] / 0.9, r["steady" + against] / 0.95)


def show(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'point':>5} {'seed':>4} {'whole':>6} {'steady':>6} {'best fixed':>10}  run s  server")
    for r in sorted(rows, key=shortfall):
        mark = "" if shortfall(r) >= 1 else "  <-- below goal"
        print(f"{r['index']:>5} {r['seed']:>4} {r['whole']:6.3f} {r['steady']:6.3f} "
              f"{r['best_whole']:>4}/{r['best_steady']:<5} {r['seconds']:6.0f}  {r['name']}{mark}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=1, help="runs of every point (different seeds)")
    parser.add_argument("--worst", type=int, default=6, help="points run three times more, worst first")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", type=int, nargs="*", help="these point indices")
    parser.add_argument("--controller", default="bracket", choices=["bracket", "gradient", "aimd", "bandit", "paired",
                                                                           "hybrid"])
    parser.add_argument("--unstreamed", action="store_true", help="auto learns of each answer when it ends")
    parser.add_argument("--no-drift", action="store_true", help="no slow drift of the whole engine")
    parser.add_argument("--floor", action="store_true", help="also the reference level itself, on other luck")
    parser.add_argument("--floor-offset", type=int, default=1000, help="the floor's luck: seed + this")
    parser.add_argument("--common-luck", action="store_true", help="auto and the fixed levels share each seed's luck")
    args = parser.parse_args()
    streamed = not args.unstreamed
    points, out = grid(), held_out()
    if args.no_drift:
        points = [(replace(engine, drift=False), start, seconds) for engine, start, seconds in points]
    chosen = args.only if args.only else range(len(points))
    tasks = [(i, points[i], seed, args.controller, streamed, args.common_luck)
             for i in chosen for seed in range(args.seeds)]
    with Pool(args.jobs) as pool:
        rows = against_best_level(pool.map(run_point, tasks))
        tuned = [r for r in rows if r["index"] not in out]
        show(tuned, "tuning points (worst first): auto / best fixed level, whole run and steady (second half)")
        show([r for r in rows if r["index"] in out], f"held-out points {sorted(out)} (never tuned on)")
        for label, part in (("tuning", tuned), ("held-out", [r for r in rows if r["index"] in out])):
            if part:
                print(f"{label}: worst whole {min(r['whole'] for r in part):.3f}, worst steady "
                      f"{min(r['steady'] for r in part):.3f}, points below goal "
                      f"{sum(shortfall(r) < 1 for r in part)}/{len(part)}; against each run's own best fixed run: "
                      f"{min(r['whole_run_best'] for r in part):.3f} / {min(r['steady_run_best'] for r in part):.3f}, "
                      f"{sum(shortfall(r, '_run_best') < 1 for r in part)}/{len(part)} below")
        if args.floor:
            floor = pool.map(run_floor, [(r, points[r["index"]], args.floor_offset, args.common_luck) for r in rows])
            print(f"\nthe floor (the reference level from the start, on other luck: seed + {args.floor_offset}): "
                  f"{sum(shortfall(r) < 1 for r in floor)} of {len(floor)} runs below goal")
            for label, part in (("tuning", [r for r in floor if r["index"] not in out]),
                                ("held-out", [r for r in floor if r["index"] in out])):
                if part:
                    print(f"  {label}: {sum(shortfall(r) < 1 for r in part)}/{len(part)} below, worst whole "
                          f"{min(r['whole'] for r in part):.3f}, worst steady {min(r['steady'] for r in part):.3f}")
            missed = [r for r in floor if shortfall(r) < 1]
            if missed:
                print(f"  their points {sorted({r['index'] for r in missed})}; there the reference level's tok/s "
                      f"spread (sd of log, steady half) {span(missed, 3)} over 3-s windows, {span(missed, 30)} in 30 s")
        if args.worst:
            worst = sorted({r["index"] for r in sorted(rows, key=shortfall)[:args.worst]},
                           key=lambda i: min(shortfall(r) for r in rows if r["index"] == i))
            again = against_best_level(pool.map(run_point, [(i, points[i], 100 + k, args.controller, streamed,
                                                             args.common_luck) for i in worst for k in range(3)]))
            print("\nthe worst points, three more runs each (seeds 100-102):")
            for i in worst:
                runs = [r for r in again if r["index"] == i]
                whole, steady = (", ".join(f"{r[k]:.3f}" for r in runs) for k in ("whole", "steady"))
                print(f"{i:>5}{' (held-out)' if i in out else ''}: whole {whole}; steady {steady}  {runs[0]['name']}")


if __name__ == "__main__":
    main()
