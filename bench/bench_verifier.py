"""Time rewards.py against math-verify on MATH-500 (gold answer, solution) pairs, in one process.

Usage:
  pip install -r bench/requirements.txt          # math-verify: only this comparison needs it
  python bench/bench_verifier.py                 # data from $SHARED_DATA_DIR or ../shared/data
  python bench/bench_verifier.py --repeat 5

Two workloads, each run through both verifiers:
  matched    gold answer i vs solution i: every pair is equal (the README's 500/500 sanity figure);
  shifted    gold answer i vs solution i+1: almost every pair differs, so rewards.py sends ~40% of
             them to its worker processes: closer to RL, where most sampled answers are wrong.
rewards.py is timed through score_batch (what train.py and eval.py call) with its worker pool
already started; math-verify through parse + verify per pair, gold wrapped in $...$ as its README
advises for LaTeX answers. The best of --repeat runs is reported for both. Without math-verify only
rewards.py is timed.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from bench import cli
from rewards import RewardConfig, score_batch


def time_ours(solutions, golds, repeat):
    best, correct = float("inf"), []
    for _ in range(repeat):
        t0 = time.perf_counter()
        correct = score_batch(solutions, golds, RewardConfig()).correct
        best = min(best, time.perf_counter() - t0)
    return best, sum(correct)


def time_math_verify(solutions, golds, repeat):
    from math_verify import parse, verify
    best, equal = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        equal = sum(bool(verify(parse(f"${g}$"), parse(s))) for s, g in zip(solutions, golds))
        best = min(best, time.perf_counter() - t0)
    return best, equal


def main():
    parser = cli.Parser(__file__, __doc__)
    shared = Path(__file__).resolve().parents[2] / "shared" / "data"
    default = Path(os.environ.get("SHARED_DATA_DIR", shared))
    parser.add_argument("--data", type=Path, default=default,
                        help="shared data folder (holds benchmarks/)")
    parser.add_argument("--repeat", type=cli.positive_int, default=3,
                        help="timed runs per verifier and workload; best is kept")
    args = parser.parse_args()
    data = args.data / "benchmarks" / "math500_test.jsonl"
    if not data.is_file():
        parser.error(f"--data {args.data}: no benchmarks/math500_test.jsonl in it")

    lines = data.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    golds = [r["answer"] for r in rows]
    workloads = {"matched": [r["solution"] for r in rows],
                 "shifted": [rows[(i + 1) % len(rows)]["solution"] for i in range(len(rows))]}
    try:
        import math_verify  # noqa: F401
        have_mv = True
    except ImportError:
        have_mv = False
        print("math-verify is not installed (pip install -r bench/requirements.txt): "
              "timing rewards.py alone")

    t0 = time.perf_counter()
    # start the worker pool outside the timings
    score_batch(["\\boxed{x+1}"], ["1+x"], RewardConfig())
    print(f"worker pool start-up (once per process): {time.perf_counter() - t0:.2f} s")
    if have_mv:
        time_math_verify(workloads["matched"][:5], golds[:5], 1)  # import, warm up its caches

    for name, solutions in workloads.items():
        n = len(solutions)
        ours_s, ours_eq = time_ours(solutions, golds, args.repeat)
        print(f"\n{name}: {n} MATH-500 pairs, judged equal / seconds / pairs per second")
        print(f"  rewards.py    {ours_eq:4d}/{n}  {ours_s:7.3f} s  {n / ours_s:9.0f}/s")
        if have_mv:
            mv_s, mv_eq = time_math_verify(solutions, golds, args.repeat)
            print(f"  math-verify   {mv_eq:4d}/{n}  {mv_s:7.3f} s  {n / mv_s:9.0f}/s")
            print(f"  throughput ratio rewards.py / math-verify: {mv_s / ours_s:.1f}x")


if __name__ == "__main__":
    main()
