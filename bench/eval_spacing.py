"""Does evaluating every 10 steps instead of every 5 keep the area's noise? (issue #32)

Usage:
  python bench/eval_spacing.py runs/repro  # every finished <arm>-s<seed> run in the folder
  python bench/eval_spacing.py runs/repro --every 10 --budget 609527

Evaluation never changes training (its sampling has its own RNG stream), so the evals of a run at
multiples of `--every` are exactly what a run with `eval.every: <every>` would have logged. Per arm,
for its runs evaluated every 5 steps: the seed-to-seed standard deviation of the area
(analysis.compare.area) from every eval and from the coarser grid only, and the mean and standard
deviation of their per-run difference, the error the coarser grid adds. The budget defaults to the
shortest `none` run's generated tokens, as analysis/compare.py's does.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis.compare import area, load_run
from bench import cli


def main() -> int:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--every", type=cli.positive_int, default=10,
                    help="the coarser eval spacing, in steps")
    ap.add_argument("--budget", type=cli.positive_float, default=None,
                    help="generated tokens (default: none's)")
    a = ap.parse_args()
    if not a.folder.is_dir():
        ap.error(f"{a.folder}: not a folder")
    finished = sorted(p.parent for p in a.folder.glob("*-s*/summary.json"))
    try:
        runs = [load_run(p) for p in finished]
    except (OSError, ValueError) as e:
        ap.error(str(e))
    fine = [run for run in runs if [c[0] for c in run["curve"][:2]] == [0, 5]]
    base = [run["tokens"] for run in runs if run["strategy"] == "none"]
    if not fine or (a.budget is None and not base):
        ap.error(f"{a.folder}: no finished run evaluated every 5 steps (and a none run)")
    budget = a.budget or min(base)
    print(f"area to {budget:,.0f} tokens; every 5 steps against every {a.every}")
    arms = {}
    for run in fine:
        coarse = [c for c in run["curve"] if c[0] % a.every == 0]
        pair = (area(run["curve"], budget), area(coarse, budget))
        if None not in pair:
            arms.setdefault(run["strategy"], []).append(pair)
    print("arm        runs  sd every 5  sd coarse  mean(coarse - 5)  sd(coarse - 5)")
    for name, pairs in sorted(arms.items()):
        if len(pairs) < 2:
            continue
        diff = [c - f for f, c in pairs]
        sd_fine = statistics.stdev(f for f, _ in pairs)
        sd_coarse = statistics.stdev(c for _, c in pairs)
        print(f"{name:10s} {len(pairs):4d}  {sd_fine:10.4f}  {sd_coarse:9.4f}  "
              f"{statistics.mean(diff):+16.4f}  {statistics.stdev(diff):14.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
