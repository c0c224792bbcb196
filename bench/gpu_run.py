"""The run on a real GPU (issues #41, #56): the CUDA paths of a paper config through one H100 or
H200, step after step, each under its own time cap so that a slow step cannot eat the rest. Writes
<out>/gpu_run.json (again after every step) and <out>/gpu_run.log (every child's output, as it
comes: a step cut by its cap keeps the figures it printed).

  python bench/gpu_run.py --dry-run --out /tmp/gpu_dry   # every step on a CPU at toy sizes
  python bench/gpu_run.py --steps env generation --budget 270 --out $OUT/call1   # call 1
  python bench/gpu_run.py --steps full --budget 240 --out $OUT/call2              # call 2
  python bench/gpu_run.py --steps lora --budget 180 --out $OUT/call3   # if time is left

The plan for 15 minutes of one H100 (the device's start, 1-3 minutes, counts): call 1 (the
principal target, ≤ 270 s), call 2 (≤ 240 s), then either a rerun of a failed call or `lora`
(≤ 180 s). Run each call with a device timeout 30 s above its --budget.

Steps:
  env         GPU, memory, driver; torch, CUDA, triton, transformers and peft versions; a bf16
              matmul's TFLOP/s (the peak the MFU divides by, beside the datasheet's).
  check       `torchrun --nproc_per_node=1`: the process group's backend map (cuda:nccl beside
              cpu:gloo), an all-reduce of a host and a device tensor, an FSDP2 root taking an AdamW
              step; then bench/gpu_check.py at Qwen2.5-0.5B's shape (train.py under torchrun with
              FSDP, two steps and a --resume, generation, the log-prob gap, the update).
  generation  bench/generation.py at Qwen2.5-1.5B's shape and vocabulary (151,936), bf16: 256 rows
              (32 prompts x 8) of up to 1,024 new tokens ending at random lengths (mean 256), 128
              slots, prompts of 512; refill_static (the compiled refill loop), default (today's
              path) and static_packed (HF's compiled static step, packed GQA) on the one workload,
              in that order, each arm's figures in the log and its JSON as measured, with what
              compiled. Target: 10,000 useful tokens/s.
  full        full fine-tuning at Qwen2.5-1.5B's shape (random weights, bf16 compute, float32
              masters, FSDP2 on one GPU, the chunked head): one step of 16 prompts x 8 (512 +
              1,024 tokens): generation on the default path, the log-prob gap, the cold and a warm
              update's MFU, peak memory against bench/memory_plan.py (±10 %); with --extras the
              TF32 head, a 4x micro-batch and a profile.
  lora        rank-32 LoRA at Qwen3-4B-Base's shape (bf16 base), one step; memory against its plan.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import cli
from support.util import OneLineParser, path_fault, run_capped

CHECK = [sys.executable, str(REPO / "bench" / "gpu_check.py")]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
CAPS = {"env": 30, "check": 240, "generation": 240, "full": 240, "lora": 180}
"""Seconds each step may take on the GPU (a dry run gets the same)."""
MIN_CAP = 20  # seconds: a step with less of the budget left is not run
DRY = ["--shape", "dry", "--prompts", "2", "--group-size", "2", "--prompt-tokens", "16",
       "--max-new-tokens", "12", "--allow-cpu"]
"""gpu_check's sizes in a dry run (every step's): the tiny model on the CPU."""
ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
       "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, or one line on stderr and exit 2: an unknown step, no step, a budget no step
    fits in, an --out or --work no file system can hold."""
    ap = OneLineParser(prog="gpu_run.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder of gpu_run.json and gpu_run.log (default: docs/gpu; for "
                    "a dry run a new temporary folder: it never replaces the GPU run's record)")
    ap.add_argument("--work", default="/tmp/gpu_run", help="scratch folder (models, runs)")
    ap.add_argument("--dry-run", action="store_true", help="every step on a CPU at toy sizes")
    ap.add_argument("--steps", nargs="+", default=list(CAPS), choices=list(CAPS))
    ap.add_argument("--budget", type=seconds, default=550, help="seconds for all steps together")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the gpu_run.json and gpu_run.log --out holds")
    ap.add_argument("--extras", action="store_true",
                    help="full: also the TF32 head, a 4x micro-batch and a profile")
    ap.add_argument("--rank-check", action="store_true", help=argparse.SUPPRESS)  # torchrun's child
    a = ap.parse_args(argv)
    for flag, path in (("--out", a.out), ("--work", a.work)):
        fault = None if path is None else path_fault(path) if path.strip() else "is empty"
        if fault:
            ap.error(f"{flag} {path!r} {fault}")
    return a


def seconds(text: str) -> float:
    """--budget: finite and at least MIN_CAP seconds (less runs no step and exits as if done)."""
    value = float(text)  # (ValueError: argparse's "invalid seconds value")
    if not MIN_CAP <= value < math.inf:  # (NaN is not)
        raise argparse.ArgumentTypeError(f"must be finite and ≥ {MIN_CAP} s (no step runs on "
                                         f"less), got {text}")
    return value


def folders(a) -> Report:
    """The scratch folder, then the output folder and its report, or one line on stderr and exit
    2. A dry run without --out writes to a new temporary folder."""
    out = a.out or "docs/gpu"
    for name in ("gpu_run.json", "gpu_run.log"):  # an earlier run's record: never replaced unasked
        if a.out is not None and (Path(out) / name).exists() and not a.overwrite:
            fail(f"--out {out} holds a run's {name}; pass --overwrite to replace it")
    try:
        Path(a.work).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--work {a.work}: cannot make the folder: {e.strerror or e}")
    try:
        if a.dry_run and a.out is None:  # docs/gpu holds the GPU run's record: never a dry run's
            out = tempfile.mkdtemp(prefix="gpu_run_dry_")
        return Report(Path(out), a.dry_run)
    except OSError as e:
        fail(f"--out {out}: cannot write its folder: {e.strerror or e}")


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit 2."""
    print(f"gpu_run.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class Report:
    """The JSON and the log, both rewritten as the run goes, so a run cut short keeps its
    figures."""

    def __init__(self, out: Path, dry: bool):
        out.mkdir(parents=True, exist_ok=True)
        self.json, self.log = out / "gpu_run.json", out / "gpu_run.log"
        self.log.write_text("")
        self.data = {"dry_run": dry, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}

    def say(self, text: str) -> None:
        print(text, flush=True)
        with self.log.open("a") as f:
            f.write(text + "\n")

    def step(self, name: str, result: dict) -> None:
        self.data["steps"][name] = result
        self.json.write_text(json.dumps(self.data, indent=1, default=str) + "\n")


def child(cmd: list[str], report: Report, timeout: float, env: dict | None = None) -> tuple:
    """Run `cmd` to its end or `timeout`, its output going to the log as it comes (a child cut by
    its cap keeps what it printed). (exit code, output, seconds); the code is None when the cap
    stopped it."""
    report.say(f"$ {' '.join(cmd)}")
    start = report.log.stat().st_size
    t0 = time.time()
    with report.log.open("a") as log:
        code, _, _ = run_capped(cmd, timeout, cwd=REPO, env=env or ENV, stdout=log,
                                stderr=subprocess.STDOUT)
    with report.log.open() as log:
        log.seek(start)
        out = log.read()
    return code, out, time.time() - t0


# ------------------------------------------------------------------------------------------- env
def env_step(a, report: Report, cap: float) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    n = 256 if a.dry_run else 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):  # warm-up
        x @ y
    cli.sync(device)
    t0 = time.time()
    for _ in range(10):
        x @ y
    cli.sync(device)
    tflops = 10 * 2 * n**3 / (time.time() - t0) / 1e12
    r = {"gpu": "none (CPU dry run)", "gpu_memory_gb": 0, **cli.versions(),
         "python": platform.python_version(), "bf16_matmul_tflops": tflops, "matmul_size": n}
    if cuda:
        r["gpu"] = torch.cuda.get_device_name()
        r["gpu_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
    report.data["device"] = r["gpu"]
    report.data["peak_tflops"] = tflops
    report.say(f"env: {r['gpu']}, {r['gpu_memory_gb']:.0f} GB, driver {r['driver']}, torch "
               f"{r['torch']} (CUDA {r['cuda']}, triton {r['triton']}), transformers "
               f"{r['transformers']}, peft {r['peft']}; bf16 {n}^3 matmul {tflops:.0f} TFLOP/s")
    return {"status": "passed", **r}


# ----------------------------------------------------------------------------------------- check
def rank_check() -> None:
    """Under torchrun --nproc_per_node=1: support/parallel.init's process group, an all-reduce of a
    host and a device tensor, and an FSDP2 root (fully_shard) taking an AdamW step. One JSON
    line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from support import parallel

    parallel.init()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    host, dev = torch.ones(3), torch.ones(3, device=device)
    dist.all_reduce(host)
    dist.all_reduce(dev)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    fully_shard(model.to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model[0].weight.full_tensor().clone()
    model(torch.randn(8, 16, device=device)).square().mean().backward()
    optimizer.step()
    moved = bool((model[0].weight.full_tensor() != before).any())
    print("RANK_CHECK " + json.dumps({
        "backend_map": dist.get_backend_config(), "device": str(device),
        "all_reduce_host": host.tolist(), "all_reduce_device": dev.tolist(),
        "fsdp_param": type(model[0].weight).__name__, "fsdp_step_moved": moved}), flush=True)
    dist.destroy_process_group()


def check_step(a, report: Report, cap: float) -> dict:
    t0 = time.time()
    code, out, _ = child([*TORCHRUN, str(Path(__file__)), "--rank-check"], report, cap / 3)
    line = [ln for ln in out.splitlines() if ln.startswith("RANK_CHECK ")]
    ranks = json.loads(line[-1].split(" ", 1)[1]) if line else {"error": tail(out)}
    want = "cuda:nccl" if not a.dry_run else "cpu:gloo"
    ok = code == 0 and want in ranks.get("backend_map", "") and ranks.get("fsdp_step_moved")
    report.say(f"check: torchrun's rank: {ranks}")
    sizes = [*DRY, "--max-grad-norm-diff", "0.1"]
    if not a.dry_run:
        sizes = ["--shape", "Qwen/Qwen2.5-0.5B", "--prompts", "4", "--group-size", "8",
                 "--prompt-tokens", "256", "--max-new-tokens", "256"]
    found = gpu_check(a, report, sizes, cap - (time.time() - t0), "check")
    passed = ok and found["status"] == "passed"
    return {**found, "status": "passed" if passed else "failed", "rank_check": ranks}


def gpu_check(a, report: Report, sizes: list[str], timeout: float, name: str) -> dict:
    """bench/gpu_check.py with `sizes`, its figures read from its --json."""
    figures = Path(a.work) / f"{name}.json"
    figures.unlink(missing_ok=True)
    peak = []
    if "peak_tflops" in report.data:  # the env step's bf16 matmul, when it ran first
        peak = ["--peak-tflops", str(report.data["peak_tflops"])]
    code, out, seconds = child([*CHECK, *sizes, *peak, "--json", str(figures)], report, timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith(("(", "gpu_check:"))]
    for ln in lines:
        print(f"{name}: {ln}", flush=True)  # (the log has it already)
    r = json.loads(figures.read_text()) if figures.exists() else {}
    status = {0: "passed", None: "timeout"}.get(code, "failed")
    return {"status": status, "exit": code, "seconds": seconds, "lines": lines, **r,
            "tail": tail(out) if code else ""}


def tail(out: str, n: int = 6) -> str:
    return "\n".join(out.strip().splitlines()[-n:])


# ------------------------------------------------------------------------------------ full, lora
def full_step(a, report: Report, cap: float) -> dict:
    sizes = ["--shape", "Qwen/Qwen2.5-1.5B", "--prompts", "16", "--group-size", "8",
             "--prompt-tokens", "512", "--max-new-tokens", "1024", "--skip-torchrun"]
    if a.dry_run:
        sizes = [*DRY, "--max-grad-norm-diff", "0.1", "--skip-torchrun"]
    if a.extras:
        sizes += ["--extras", "--profile"]
    return gpu_check(a, report, sizes, cap, "full")


def lora_step(a, report: Report, cap: float) -> dict:
    sizes = ["--shape", "Qwen/Qwen3-4B-Base", "--lora", "32", "--prompts", "8", "--group-size",
             "8", "--prompt-tokens", "512", "--max-new-tokens", "512", "--skip-torchrun"]
    if a.dry_run:
        sizes = [*DRY, "--lora", "4", "--skip-torchrun"]
    return gpu_check(a, report, sizes, cap, "lora")


# ------------------------------------------------------------------------------------ generation
TARGET = 10_000  # useful tokens/s of a whole rollout at Qwen2.5-1.5B's shape (issues #50, #56)
ARMS = ("refill_static", "default", "static_packed")  # generation's arms, the target's first


def generation_step(a, report: Report, cap: float) -> dict:
    """bench/generation.py's refill_static, default and static_packed arms on one workload (see
    the steps above). Passes when every arm ran and the best reaches TARGET. The dry run compiles
    the static arms on the CPU (--compile-anywhere): the compiled path a GPU takes, proven first."""
    sizes = ["--shape", "1.5b", "--layers", "0", "--rows", "256", "--slots", "128",
             "--max-new", "1024", "--mean-len", "256", "--prompt-tokens", "512", "--same-length",
             "--dtype", "bfloat16", "--device", "cuda", "--repeats", "1"]
    if a.dry_run:
        sizes = ["--layers", "2", "--vocab", "4096", "--rows", "8", "--group", "2", "--slots", "4",
                 "--prompt-tokens", "16", "--max-new", "24", "--mean-len", "8", "--same-length",
                 "--repeats", "1", "--compile-anywhere"]
    out = Path(a.work) / "generation.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "bench" / "generation.py"), *sizes,
           "--arms", ",".join(ARMS), "--json", str(out)]
    code, text, _ = child(cmd, report, cap)
    for ln in text.splitlines():
        if ln.split(":", 1)[0] in ARMS:
            print(f"generation: {ln}", flush=True)
    if not out.is_file():
        return {"status": "failed", "exit": code, "tail": tail(text)}
    r = json.loads(out.read_text())
    best = max([arm["tokens_per_s"] for arm in r["arms"].values()], default=0.0)
    status = "passed"
    if code != 0 or len(r["arms"]) < len(ARMS):
        status = "failed"
    if status == "passed" and best < TARGET and not a.dry_run:
        status = "missed"
    return r | {"status": status, "exit": code, "target_tokens_per_s": TARGET}


STEPS = {"env": env_step, "check": check_step, "generation": generation_step,
         "full": full_step, "lora": lora_step}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.rank_check:
        rank_check()
        return 0
    import torch

    if not torch.cuda.is_available() and not a.dry_run:
        fail("no GPU is visible; on a CPU run it with --dry-run")
    report = folders(a)
    report.say(f"gpu_run: writing {report.json} and {report.log}")
    t0 = time.time()
    spent = 0.0  # seconds the steps before took: the first step has the whole budget (≥ MIN_CAP)
    for name in a.steps:
        left = a.budget - spent
        cap = min(CAPS[name], left)
        if cap < MIN_CAP:
            why = f"{left:.0f} s of the budget left, under the {MIN_CAP} s a step needs"
            report.say(f"== {name}: not run ({why})")
            report.step(name, {"status": "not run", "why": why})
            continue
        s0 = time.time()
        try:
            result = STEPS[name](a, report, cap)
        except Exception as e:  # one step's failure is its result; the next steps still run
            result = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        result["step_seconds"] = time.time() - s0
        spent = time.time() - t0
        report.say(f"== {name}: {result['status']} in {result['step_seconds']:.0f} s")
        report.step(name, result)
    statuses = {n: s["status"] for n, s in report.data["steps"].items()}
    report.data["total_seconds"] = time.time() - t0
    report.step("env", report.data["steps"].get("env", {"status": "not run"}))
    report.say(f"gpu_run: {statuses} in {time.time() - t0:.0f} s")
    return 0 if all(s == "passed" for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
