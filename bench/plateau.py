"""Has a baseline plateaued? Its last three evals within one standard error, per seed and on the seed-mean curve.

Usage:
  python bench/plateau.py runs/repro/none-s0 runs/repro/none-s1 runs/repro/none-s2 runs/repro/none-s3 runs/repro/none-s4

Per run: the last three `eval/accuracy` values and their spread (max − min) against that run's last standard error
(`eval/accuracy_se`, over problems). On the seed mean: the same spread against the standard error of the mean
eval (the per-run SE / √seeds). Exit 0 when the seed-mean curve's last three evals are within one of its SE.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def evals(run: Path) -> list[tuple[int, float, float]]:
    """(step, accuracy, its standard error) for every eval of a run, in step order."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r["step"], r["eval/accuracy"], r["eval/accuracy_se"]) for r in rows if "eval/accuracy" in r)


def main(runs: list[Path]) -> int:
    curves = [evals(r) for r in runs]
    for run, curve in zip(runs, curves, strict=True):
        last = curve[-3:]
        accs = [a for _, a, _ in last]
        spread, se = max(accs) - min(accs), last[-1][2]
        print(f"{run}: steps {[s for s, _, _ in last]} acc {[round(a, 3) for a in accs]} "
              f"spread {spread:.3f} vs SE {se:.3f} -> {'flat' if spread <= se else 'moving'}")
    steps = sorted(set.intersection(*({s for s, _, _ in c} for c in curves)))[-3:]
    mean = [sum({s: a for s, a, _ in c}[t] for c in curves) / len(curves) for t in steps]
    se = sum(c[-1][2] for c in curves) / len(curves) / len(curves) ** 0.5
    spread = max(mean) - min(mean)
    print(f"seed mean ({len(curves)} runs): steps {steps} acc {[round(m, 3) for m in mean]} spread {spread:.3f} "
          f"vs SE {se:.3f} -> {'plateaued' if spread <= se else 'still moving'}")
    return 0 if spread <= se else 1


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__.strip().splitlines()[0] + "\nusage: python bench/plateau.py RUN_DIR [RUN_DIR ...]")
    sys.exit(main([Path(a) for a in sys.argv[1:]]))
