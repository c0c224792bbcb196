"""Reproduce the replay claims at tiny scale: every strategy × 3 seeds on the embedded task, then the comparison.

Usage:
  python bench/reproduce_tiny.py                         # runs/repro/<strategy>-s<seed>, then eval.py --compare
  python bench/reproduce_tiny.py --seeds 0 1 2 --jobs 2 --out runs/repro --strategies none aper
  python bench/reproduce_tiny.py --configs configs/tiny_half --strategies none uniform aper --out runs/repro_half

Order: the `none` runs go first; RLEP's phase I then samples 8 answers per training problem from the final
model of `none` seed 0 and keeps the verified-correct ones (as RLEP collects them from a finished run); then the
other strategies. Every run uses <configs>/<strategy>.yaml (default configs/tiny/, which differ only in
`replay.*`: same fresh rollouts per step, same steps, so the same generation budget). Runs already finished
(summary.json present) are kept, so an interrupted reproduction can simply be started again.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ["none", "uniform", "aper", "rlep", "exgrpo"]


def train(configs: str, strategy: str, seed: int, out: Path, extra: list[str]) -> Path:
    run = out / f"{strategy}-s{seed}"
    if (run / "summary.json").exists():
        print(f"[skip] {run} is finished", flush=True)
        return run
    cmd = [sys.executable, "train.py", "--config", f"{configs}/{strategy}.yaml", f"--out_dir={run}", f"--seed={seed}",
           "--overwrite", f"--wandb.name={strategy}-s{seed}", *extra]
    t0 = time.time()
    with open(out / f"{strategy}-s{seed}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT)
    print(f"[done] {run} in {time.time() - t0:.0f}s", flush=True)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/repro")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    ap.add_argument("--configs", default="configs/tiny", help="folder with one <strategy>.yaml per strategy")
    ap.add_argument("--jobs", type=int, default=2, help="training processes at once (each uses one thread)")
    a, extra = ap.parse_known_args()  # anything else is passed to train.py as an override
    missing = [s for s in a.strategies if not (REPO / a.configs / f"{s}.yaml").exists()]
    if missing:
        sys.exit(f"error: no {', '.join(f'{a.configs}/{s}.yaml' for s in missing)}; pick --strategies that have one")
    out = (REPO / a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with ThreadPoolExecutor(a.jobs) as pool:
        if "none" in a.strategies:
            list(pool.map(lambda s: train(a.configs, "none", s, out, extra), a.seeds))
        rlep_extra = []
        if "rlep" in a.strategies:
            phase1 = out / "rlep_phase1.jsonl"
            if not phase1.exists():
                base = out / f"none-s{a.seeds[0]}" / "final"
                subprocess.run(
                    [sys.executable, "eval.py", "--model", str(base), "--benchmarks", "tiny_train", "--k", "8",
                     "--temperature", "1.0", "--top-p", "1.0", "--max-new-tokens", "48", "--template", "{problem}",
                     "--batch-size", "256", "--save-correct", str(phase1), "--out-dir", str(out / "rlep_phase1")],
                    cwd=REPO, check=True,
                )
            rlep_extra = [f"--replay.rlep_source={phase1}"]
        jobs = [(s, seed) for s in a.strategies if s != "none" for seed in a.seeds]
        list(pool.map(lambda j: train(a.configs, j[0], j[1], out, extra + (rlep_extra if j[0] == "rlep" else [])), jobs))
    print(f"all runs finished in {(time.time() - t0) / 60:.1f} min", flush=True)
    runs = [str(out / f"{s}-s{seed}") for s in a.strategies for seed in a.seeds]
    subprocess.run([sys.executable, "eval.py", "--compare", *runs, "--out-dir", str(out / "compare")], cwd=REPO, check=True)


if __name__ == "__main__":
    main()
