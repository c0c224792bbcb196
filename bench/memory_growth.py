"""Does a long run leak? Run train.py for 1,000 tiny steps and track its resident memory (RSS) step
by step.

Usage:
  python bench/memory_growth.py --overwrite  # 1,000 steps, replaces the committed record,
                                             # bench/results/memory_growth.{csv,png}
  python bench/memory_growth.py --steps 300 --warmup 50 --out /tmp/growth -- \
      --model.path=/tmp/model --replay.strategy=aper

train.py runs in a child process exactly as a user would start it (one thread, wandb off,
checkpoints every 100 steps, uniform replay so the buffer is exercised); this script reads the
child's VmRSS from /proc every 0.2 s and the step from its metrics.jsonl. Growth = (median RSS over
the last 50 steps − median RSS over the 50 steps after warm-up) / the latter; the target is < 5%.
Medians, because RSS jitters by a few % as the allocator takes and returns pages. Memory that
settles during warm-up (allocator pools, lazily built kernels, the first checkpoint) is not a leak;
memory that keeps climbing with steps is. Linux only (/proc).
The verifier's worker processes are separate processes with their own, bounded memory; they are not
counted.
"""

from __future__ import annotations

import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench import cli

SMALL = [  # the tiny task at a quarter of the default batch: ~0.5 s per step on one CPU thread
    "--rollout.batch_size=32", "--rollout.group_size=4", "--eval.every=0", "--eval.n=10",
    "--checkpoint.every=100",
    "--replay.strategy=uniform", "--replay.ratio=0.25", "--wandb.mode=disabled", "--threads=1",
]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB -> MB
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def steps_done(metrics: Path) -> int:
    try:
        with open(metrics, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def main() -> None:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--steps", type=cli.positive_int, default=1000)
    ap.add_argument("--warmup", type=cli.count, default=100,
                    help="step after which memory should stop growing")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "memory_growth"),
                    help="writes OUT.csv and OUT.png")
    ap.add_argument("--overwrite", action="store_true", help="replace OUT.csv and OUT.png")
    ap.add_argument("overrides", nargs="*", help="extra train.py overrides, after --")
    a = ap.parse_args()
    if a.warmup >= a.steps:
        ap.error(f"--warmup {a.warmup} leaves no step of --steps {a.steps} to measure")
    for suffix in (".csv", ".png"):
        ap.check_file("--out", str(Path(a.out).with_suffix(suffix)), a.overwrite,
                      makes_folder=True)
    ap.check_config(str(REPO / a.config), [*SMALL, f"--max_steps={a.steps}", *a.overrides])

    run_dir = Path(tempfile.mkdtemp(prefix="memory_growth_"))
    cmd = [sys.executable, str(REPO / "train.py"), "--config", a.config, *SMALL,
           f"--max_steps={a.steps}",
           f"--out_dir={run_dir / 'run'}", *a.overrides]
    print(" ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    samples, t0 = [], time.time()  # (step, seconds, rss MB)
    with open(run_dir / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
        while proc.poll() is None:
            rss = rss_mb(proc.pid)
            if rss is not None:
                samples.append((steps_done(run_dir / "run" / "metrics.jsonl"),
                                time.time() - t0,
                                rss))
                if (samples[-1][0] % 100 == 0
                        and (len(samples) < 2 or samples[-2][0] != samples[-1][0])):
                    print(f"step {samples[-1][0]:5d}  rss {rss:7.1f} MB  {samples[-1][1]:6.0f} s",
                          flush=True)
            time.sleep(0.2)
    if proc.returncode != 0:
        sys.exit(f"train.py failed (exit {proc.returncode}); see {run_dir / 'stderr.txt'}")
    shutil.rmtree(run_dir)  # checkpoints and final weights of a throwaway run

    # RSS jitters by a few % as the allocator takes and returns pages, so compare medians over
    # W-step windows: the first W steps after warm-up against the last W steps of training (the
    # final eval and save excluded).
    W = max(1, min(50, (a.steps - a.warmup) // 4))
    in_loop = [s for s in samples if a.warmup <= s[0] < a.steps]
    if not in_loop:
        sys.exit("no samples after warm-up: raise --steps or lower --warmup")
    last = max(s[0] for s in in_loop)
    warm = statistics.median(s[2] for s in in_loop if s[0] < a.warmup + W)
    end = statistics.median(s[2] for s in in_loop if s[0] > last - W)
    peak = max(s[2] for s in in_loop)
    growth = 100 * (end - warm) / warm
    print(f"median RSS, steps {a.warmup}-{a.warmup + W - 1} (after warm-up): {warm:.1f} MB")
    print(f"median RSS, steps {last - W + 1}-{last} (end):           {end:.1f} MB")
    print(f"peak RSS after warm-up: {peak:.1f} MB ({100 * (peak - warm) / warm:+.2f}%)")
    print(f"growth after warm-up: {growth:+.2f}% ({'PASS' if growth < 5 else 'FAIL'}: target < 5%)")

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "seconds", "rss_mb"])
        w.writerows((s, f"{t:.1f}", f"{r:.1f}") for s, t, r in samples)
    print(f"wrote {out.with_suffix('.csv')}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, skipping the figure (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s[0] for s in samples], [s[2] for s in samples], lw=1)
    ax.axvline(a.warmup, color="grey", ls="--", lw=1, label=f"warm-up ends (step {a.warmup})")
    ax.axhline(warm * 1.05, color="red", ls=":", lw=1, label="+5% over the warm-up RSS")
    ax.set(xlabel="training step", ylabel="resident memory (MB)",
           ylim=(0, max(peak, warm * 1.05) * 1.1),
           title=f"train.py RSS over {a.steps} tiny steps: {growth:+.2f}% after warm-up")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
