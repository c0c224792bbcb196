"""Keep what `eval.py --compare` reads of finished runs, small enough to commit: a comparison can
then be recomputed from the repository, and extended by seeds run later on the same versions.

  python bench/keep_runs.py runs/repro/none-s0 runs/repro/sfpo-s0 ... --out docs/kept_runs/lookahead

For each run folder it writes OUT/<name>/: config.yaml, summary.json (step 0's pass@k, maj@k and
greedy from its newest checkpoint where older code left them out), metrics.jsonl cut to its eval
rows (and the last row) with the keys analysis/compare_io.py reads, and steps.jsonl: every step's
method state (lookahead/*, optim/*, skipped/*), which claims about a run's steps rest on (when SFPO
stopped, on which steps GXPO moved, the passes each step took). A run without summary.json
(unfinished) is refused. A kept run is never replaced without --overwrite (OUT may hold committed
runs of the same name), and two runs of one name are refused: they would be kept in one folder.
Every run is read before anything is written.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from analysis.compare_io import NUMBERS, read_run  # the keys the comparison reads
from bench import cli
from support.checkpoint import kept_summary
from support.util import RunError

KEPT = {"step", *NUMBERS}
STEP_KEYS = ("lookahead/", "optim/", "skipped/")  # steps.jsonl's: every step's, by prefix
FILES = ("config.yaml", "summary.json", "metrics.jsonl", "steps.jsonl")


def kept_rows(run: Path) -> tuple[dict, list[dict], list[dict]]:
    """What is kept of `run`: kept_summary, its eval rows and last row cut to KEPT, every step's
    state; ValueError, OSError or RunError naming the file unless it is a finished, readable run."""
    for name in FILES[:3]:  # (not steps.jsonl: it is made here)
        if not (run / name).is_file():
            raise ValueError(f"{run} is not a finished run (no {name})")
    summary, _, rows = read_run(run)  # every field the comparison reads, checked
    kept = []
    for i, row in enumerate(rows):
        if "eval/accuracy" in row or i == len(rows) - 1:
            kept.append({k: v for k, v in row.items() if k in KEPT})
    return kept_summary(run, summary), kept, [step_state(row) for row in rows]


def step_state(row: dict) -> dict:
    """A metrics row's step and method state (STEP_KEYS)."""
    state = {key: value for key, value in row.items() if key.startswith(STEP_KEYS)}
    return {"step": row.get("step")} | state


def keep(run: Path, rows: tuple[dict, list[dict], list[dict]], out: Path) -> None:
    """Write the kept files of `run` into `out`: its config and `rows` (kept_rows')."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run / "config.yaml", out / "config.yaml")
    (out / "summary.json").write_text(json.dumps(rows[0], indent=2) + "\n")
    for name, kept in zip(("metrics.jsonl", "steps.jsonl"), rows[1:]):
        lines = [json.dumps(row) for row in kept]
        (out / name).write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("runs", nargs="+", help="finished run folders")
    ap.add_argument("--out", required=True, help="the folder of kept runs")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace kept runs of the same names in --out")
    a = ap.parse_args(argv)
    ap.check_folder("--out", a.out)
    out = Path(a.out)
    targets = {}  # OUT/<name>: the run kept there
    for arg in a.runs:
        run = Path(arg)
        target = out / run.resolve().name  # ("." names its folder, not OUT itself)
        if target in targets:
            ap.error(f"{targets[target]} and {run} are both named {target.name}: both would be "
                     f"kept in {target}")
        if target.resolve() == run.resolve():
            ap.error(f"{run} is already kept in {out}: it would be cut in place")
        for name in FILES:
            ap.check_file("--out", str(target / name), a.overwrite, makes_folder=True)
        targets[target] = run
    rows = {}
    for target, run in targets.items():
        try:
            rows[target] = kept_rows(run)
        except (OSError, ValueError, RunError) as e:
            ap.error(str(e))
    for target, run in targets.items():
        keep(run, rows[target], target)
        print(f"{run} -> {target} ({len(rows[target][1])} rows, {len(rows[target][2])} steps)")


if __name__ == "__main__":
    main()
