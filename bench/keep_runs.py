"""Keep what `eval.py --compare` reads of finished runs, small enough to commit: a comparison can
then be recomputed from the repository, and extended by seeds run later on the same versions.

  python bench/keep_runs.py runs/repro/none-s0 runs/repro/sfpo-s0 ... --out docs/kept_runs/lookahead

For each run folder it writes OUT/<name>/: config.yaml and summary.json as they are, and
metrics.jsonl cut to its eval rows (and the last row) with the keys analysis/compare_io.py reads.
A run without summary.json (unfinished) is refused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from analysis.compare_io import NUMBERS  # the keys the comparison reads

KEPT = {"step", *NUMBERS}


def keep(run: Path, out: Path) -> int:
    """Write the kept files of `run` into `out`; returns the metrics rows kept."""
    if not (run / "summary.json").is_file():
        raise SystemExit(f"error: {run} is not finished (no summary.json)")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "summary.json"):
        shutil.copyfile(run / name, out / name)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kept = []
    for i, row in enumerate(rows):
        if "eval/accuracy" in row or i == len(rows) - 1:
            kept.append({k: v for k, v in row.items() if k in KEPT})
    lines = [json.dumps(row) for row in kept]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return len(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    for run in a.runs:
        n = keep(run, a.out / run.name)
        print(f"{run} -> {a.out / run.name} ({n} rows)")


if __name__ == "__main__":
    main()
