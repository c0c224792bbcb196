"""Where a training step's seconds go: median time per phase of a train.py run, and the replay share
of the step.

Usage:
  python bench/profile_step.py  # configs/tiny/aper.yaml, 20 steps
  python bench/profile_step.py --config configs/tiny/uniform.yaml --steps 40 --model.path=/tmp/model

Runs train.py in a subprocess as a user would and reads the per-step `time/*` fields of
metrics.jsonl (what wandb shows too). Replay overhead is time/replay_sample + time/replay_push:
drawing rows from the buffer (and concatenating them to the batch) and writing the fresh rows in.
Their share is reported per step (median and maximum over steps 2.., once the buffer holds rows) and
over the whole run. The target is ≤ 1% of step time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench import cli


def main() -> None:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--config", default="configs/tiny/aper.yaml")
    ap.add_argument("--steps", type=cli.positive_int, default=20)
    ap.add_argument("--out", help="the run goes in OUT/run (default: a temporary folder)")
    ap.add_argument("--overwrite", action="store_true", help="replace OUT/run")
    a, overrides = ap.parse_known_args()
    ap.check_folder("--out", a.out)
    if a.out and (Path(a.out) / "run").exists() and not a.overwrite:
        ap.error(f"--out {a.out} holds a run already; pass --overwrite to replace it")
    ap.check_config(str(REPO / a.config), overrides)
    out = Path(a.out or tempfile.mkdtemp(prefix="profile_step_")) / "run"
    cmd = [sys.executable, "train.py", "--config", a.config, *overrides, f"--out_dir={out}",
           f"--max_steps={a.steps}",
           "--eval.every=0", "--checkpoint.every=0", "--wandb.mode=disabled", "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        sys.exit(p.stderr[-3000:])
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    phases = [k for k in rows[0] if k.startswith("time/") and k not in ("time/step", "time/eval")]
    step = statistics.median(r["time/step"] for r in rows)
    print(f"{a.config} {' '.join(overrides)}: {len(rows)} steps, median step {step:.3f}s")
    print(f"{'phase':22s}{'median s':>10s}{'% of step':>11s}")
    for k in phases:
        med = statistics.median(r[k] for r in rows)
        print(f"{k[5:]:22s}{med:10.4f}{100 * med / step:10.2f}%")
    later = rows[1:] or rows
    share = [(r["time/replay_sample"] + r["time/replay_push"]) / r["time/step"] for r in later]
    total = (sum(r["time/replay_sample"] + r["time/replay_push"] for r in later)
             / sum(r["time/step"] for r in later))
    print(f"replay (sample + push) share of step time, steps 2..{len(rows)}: "
          f"median {100 * statistics.median(share):.3f}%, "
          f"max {100 * max(share):.3f}%, whole run {100 * total:.3f}%  (replayed rows per step: "
          f"{statistics.median(r['replay/rows'] for r in later):.0f}, "
          f"buffer size at the end: {rows[-1]['replay/size']:.0f})")


if __name__ == "__main__":
    main()
