"""Has a baseline plateaued? Its last three evals within one standard error, per seed and on the
seed-mean curve.

Usage:
  python bench/plateau.py runs/repro/none-s{0,1,2,3,4,5,6,7,8,9}

Every curve is first cut to the evals all runs share (analysis.compare.common_grid), so runs
evaluated every 5 and every 10 steps are judged at the same steps. Per run: the last three
`eval/accuracy` values and their spread (max − min) against that run's last standard error
(`eval/accuracy_se`, over problems). On the seed mean: the same spread against the standard error
of the mean eval (the per-run SE / √seeds). Exit 0 when the seed-mean curve's last three evals are
within one of its SE, 1 when they are not, 2 on bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis.compare import common_grid, load_run, seed_mean_curve
from analysis.compare_io import given_twice
from bench import cli


def verdict(spread: float, se: float, flat: str, moving: str) -> str:
    if spread <= se:
        return flat
    return moving


def last_three(curve: list[tuple]) -> tuple[list[int], list[float], float, float]:
    """(steps, accuracies, spread, standard error of the last) of a curve's last three evals."""
    last = curve[-3:]  # (step, tokens, accuracy, se)
    steps = [c[0] for c in last]
    accs = [c[2] for c in last]
    return steps, accs, max(accs) - min(accs), last[-1][3]


def main(paths: list[Path]) -> int:
    runs = [load_run(p) for p in paths]
    common_grid(runs)
    for path, run in zip(paths, runs, strict=True):
        if len(run["curve"]) < 3:
            raise ValueError(f"{path}: fewer than three evals on the shared grid")
        steps, accs, spread, se = last_three(run["curve"])
        rounded = [round(a, 3) for a in accs]
        word = verdict(spread, se, "flat", "moving")
        print(f"{path}: steps {steps} acc {rounded} spread {spread:.3f} vs SE {se:.3f} -> {word}")
    mean_curve = seed_mean_curve(runs)
    if len(mean_curve) < 3:
        raise ValueError("the runs share fewer than three evals")
    steps, accs, spread, se = last_three(mean_curve)
    rounded = [round(a, 3) for a in accs]
    word = verdict(spread, se, "plateaued", "still moving")
    print(f"seed mean ({len(runs)} runs): steps {steps} acc {rounded} "
          f"spread {spread:.3f} vs SE {se:.3f} -> {word}")
    return int(spread > se)


if __name__ == "__main__":
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("runs", nargs="+", help="run folders of one arm")
    args = ap.parse_args()
    twice = given_twice(args.runs)  # the seed mean counts each run once
    if twice:
        ap.error(twice)
    try:
        code = main([Path(run) for run in args.runs])
    except (OSError, ValueError) as e:
        ap.error(str(e))
    sys.exit(code)
