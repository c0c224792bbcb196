"""Has a baseline plateaued? Its last three evals within one standard error, per seed and on the seed-mean curve.

Usage:
  python bench/plateau.py runs/repro/none-s0 runs/repro/none-s1 runs/repro/none-s2 runs/repro/none-s3 runs/repro/none-s4

Per run: the last three `eval/accuracy` values and their spread (max − min) against that run's last standard error
(`eval/accuracy_se`, over problems). On the seed mean: the same spread against the standard error of the mean
eval (the per-run SE / √seeds). Exit 0 when the seed-mean curve's last three evals are within one of its SE.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare import load_run, seed_mean_curve


def main(paths: list[Path]) -> int:
    runs = [load_run(p) for p in paths]
    for path, run in zip(paths, runs, strict=True):
        last = run["curve"][-3:]  # (step, tokens, accuracy, se)
        accs = [a for _, _, a, _ in last]
        spread, se = max(accs) - min(accs), last[-1][3]
        print(f"{path}: steps {[s for s, *_ in last]} acc {[round(a, 3) for a in accs]} "
              f"spread {spread:.3f} vs SE {se:.3f} -> {'flat' if spread <= se else 'moving'}")
    last = seed_mean_curve(runs)[-3:]
    mean, se = [a for _, _, a, _ in last], last[-1][3]
    spread = max(mean) - min(mean)
    print(f"seed mean ({len(runs)} runs): steps {[s for s, *_ in last]} acc {[round(m, 3) for m in mean]} "
          f"spread {spread:.3f} vs SE {se:.3f} -> {'plateaued' if spread <= se else 'still moving'}")
    return 0 if spread <= se else 1


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__.strip().splitlines()[0] + "\nusage: python bench/plateau.py RUN_DIR [RUN_DIR ...]")
    sys.exit(main([Path(a) for a in sys.argv[1:]]))
