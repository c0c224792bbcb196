"""The run on a real GPU (issue #41): every CUDA path of a paper config through one H100 or H200 in
about 8.5 minutes (its caps add up to 31), one step after another, cheapest first, each under its
own time cap, so that a slow step cannot eat the rest. Writes <out>/gpu_run.json (written again
after every step) and <out>/gpu_run.log (every child's whole output).

  python bench/gpu_run.py --out docs/gpu                 # on the GPU machine
  python bench/gpu_run.py --dry-run --out /tmp/gpu_dry   # every step on a CPU at toy sizes (~2 min)
  python bench/gpu_run.py --dry-run                      # the same into a new temporary folder
  python bench/gpu_run.py --steps tiny resume            # some steps

Steps:
  env     GPU name and memory, torch and transformers versions, a bf16 matmul's TFLOP/s (the peak
          that the MFU divides by).
  check   `torchrun --nproc_per_node=1`: the process group's backend map (cuda:nccl beside
          cpu:gloo), an all-reduce of a host and a device tensor, an FSDP2 root on one rank taking
          an AdamW step; then bench/gpu_check.py at Qwen2.5-0.5B's shape (train.py under torchrun
          with FSDP, two steps and a --resume, generation, the log-prob gap, the update, the chunked
          head).
  tiny    the default tiny run (configs/tiny.yaml, 60 steps) on CUDA: its gain (needs +20 pp), its
          wall time.
  resume  the tiny run SIGKILLed after its step-4 checkpoint and resumed to step 8, against an
          uninterrupted 8-step run: final weights and metrics bit-identical? If not, an
          uninterrupted twin says whether plain runs repeat, and the same pair under
          torch.use_deterministic_algorithms says whether that restores it, and at what cost.
  decode  bench/decode_step.py at Qwen2.5-1.5B's shape (128 rows, prompts of 512, bf16): decode
          tokens/s before (FSDP hooks on during generation, HF's DynamicCache), after (hooks off,
          the KV cache written in place) and with rollout.static_cache (compiled, CUDA graphs),
          in one run; the target is 10,000 useful tokens/s.
  refill  bench/rollout_refill.py at Qwen2.5-1.5B's shape: 512 rows (64 prompts x 8) of up to
          1,024 new tokens, rows ending at random lengths (mean 256), 128 at a time, prompts of
          512, bf16: HF generate with rollout.static_cache and rollout.pack_gqa (compiled) against
          rollout.refill with them (the slots' step compiled, CUDA graphs), in one run; useful
          tokens/s against the same 10,000.
  rollout a whole rollout at the full step's shape through rollout.generate with
          rollout.static_cache and rollout.pack_gqa (compiled by a first, untimed rollout); its
          useful tokens/s against the same 10,000 (the full step's: the default path's).
  full    full fine-tuning at Qwen2.5-1.5B's shape (random weights, bf16 compute, float32 masters,
          FSDP2 on one GPU, micro_batch_tokens packing, the chunked head): one step of 16 prompts
          x 8 (512 + 1,024 tokens). Peak memory against bench/memory_plan.py, HF generate tokens/s,
          the update's MFU, a profile of a warm update (its top kernels, the output layer's
          share), the sampler-vs-trainer log-prob gap, chunked head vs whole logits.
  lora    rank-32 LoRA at Qwen3-4B-Base's shape (bf16 base), one step; peak memory against the
          LoRA plan.
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
from support.util import OneLineParser, kill_tree, path_fault, run_capped

CHECK = [sys.executable, str(REPO / "bench" / "gpu_check.py")]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
TINY = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny.yaml"),
        "--wandb.mode=disabled"]
CAPS = {"env": 60, "check": 240, "tiny": 150, "resume": 150, "decode": 300, "refill": 240,
        "rollout": 240, "full": 300, "lora": 180}
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
    """Run `cmd` to its end or `timeout`; its whole output goes to the log. (exit code, output,
    seconds); the exit code is None when the cap stopped it."""
    report.say(f"$ {' '.join(cmd)}")
    t0 = time.time()
    code, out, _ = run_capped(cmd, timeout, cwd=REPO, env=env or ENV, stderr=subprocess.STDOUT)
    with report.log.open("a") as f:
        f.write(out)
    return code, out, time.time() - t0


# ------------------------------------------------------------------------------------------- env
def env_step(a, report: Report, cap: float) -> dict:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    n = 256 if a.dry_run else 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):  # warm-up
        x @ y
    sync(device)
    t0 = time.time()
    for _ in range(10):
        x @ y
    sync(device)
    tflops = 10 * 2 * n**3 / (time.time() - t0) / 1e12
    r = {"gpu": torch.cuda.get_device_name() if cuda else "none (CPU dry run)",
         "gpu_memory_gb": torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else 0,
         "torch": torch.__version__, "cuda": torch.version.cuda,
         "transformers": transformers.__version__, "python": platform.python_version(),
         "bf16_matmul_tflops": tflops, "matmul_size": n}
    report.data["device"] = r["gpu"]
    report.data["peak_tflops"] = tflops
    report.say(f"env: {r['gpu']}, {r['gpu_memory_gb']:.0f} GB, torch {r['torch']} (CUDA "
               f"{r['cuda']}), transformers {r['transformers']}; bf16 {n}^3 matmul "
               f"{tflops:.0f} TFLOP/s")
    return {"status": "passed", **r}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


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
        report.say(f"{name}: {ln}")
    r = json.loads(figures.read_text()) if figures.exists() else {}
    status = {0: "passed", None: "timeout"}.get(code, "failed")
    return {"status": status, "exit": code, "seconds": seconds, "lines": lines, **r,
            "tail": tail(out) if code else ""}


def tail(out: str, n: int = 6) -> str:
    return "\n".join(out.strip().splitlines()[-n:])


# ------------------------------------------------------------------------------------------ tiny
def tiny_step(a, report: Report, cap: float) -> dict:
    run = Path(a.work) / "tiny"
    short = ["--max_steps=4", "--eval.every=2", "--eval.n=16"] * a.dry_run
    code, out, seconds = child([*TINY, f"--out_dir={run}", "--overwrite", *short], report, cap)
    summary = run / "summary.json"
    if code != 0 or not summary.exists():
        return {"status": "timeout" if code is None else "failed", "exit": code, "tail": tail(out)}
    s = json.loads(summary.read_text())
    gain = s["eval_accuracy_final"] - s["eval_accuracy_initial"]
    report.say(f"tiny: {s['steps']} steps on {report.data['device']}, "
               f"eval {s['eval_accuracy_initial']:.3f} -> "
               f"{s['eval_accuracy_final']:.3f} ({100 * gain:+.1f} pp) "
               f"in {s['wall_seconds']:.0f} s "
               f"of training ({seconds:.0f} s with start-up)")
    passed = gain >= 0.20 or a.dry_run
    return {"status": "passed" if passed else "failed", "steps": s["steps"], "gain": gain,
            "eval_initial": s["eval_accuracy_initial"], "eval_final": s["eval_accuracy_final"],
            "wall_seconds": s["wall_seconds"], "process_seconds": seconds,
            "generated_tokens": s["generated_tokens"]}


# ---------------------------------------------------------------------------------------- resume
DETERMINISTIC = ("import runpy, sys, torch; "
                 "torch.use_deterministic_algorithms(True, warn_only=True); "
                 "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def resume_step(a, report: Report, cap: float) -> dict:
    t0 = time.time()
    r = {"status": "passed"}
    for mode in ("default", "deterministic"):
        left = cap - (time.time() - t0)
        pair = kill_and_resume(a, report, mode, left)
        r[mode] = pair
        report.say(f"resume ({mode}): {pair}")
        if pair.get("identical") or "error" in pair:
            break
    last = r.get("deterministic", r["default"])
    if not last.get("identical"):
        r["status"] = "failed"
    return r


def tiny_cmd(mode: str) -> tuple[list[str], dict]:
    if mode == "default":
        return TINY, ENV
    env = {**ENV, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return [sys.executable, "-c", DETERMINISTIC, *TINY[1:]], env


def kill_and_resume(a, report: Report, mode: str, budget: float) -> dict:
    """An uninterrupted 8-step run, the same killed (SIGKILL) after step 5 and resumed from its
    step-4 checkpoint, and, when they differ in the default mode, a second uninterrupted run."""
    cmd, env = tiny_cmd(mode)
    steps = ["--max_steps=8", "--checkpoint.every=4", "--eval.every=0"]
    if a.dry_run:
        steps += ["--rollout.batch_size=32"]
    base = Path(a.work) / f"resume_{mode}"
    t0 = time.time()
    code, out, plain = child([*cmd, *steps, f"--out_dir={base}_plain", "--overwrite"], report,
                             budget / 3, env)
    if code != 0:
        return {"error": f"the uninterrupted run exited {code}: {tail(out, 2)}"}
    killed = base.with_name(base.name + "_killed")
    at = sigkill_after(cmd + steps + [f"--out_dir={killed}", "--overwrite"], killed, 5, env,
                       budget / 3)
    left = budget - (time.time() - t0)
    code, out, _ = child([*cmd, *steps, f"--out_dir={killed}", "--resume"], report, left / 2, env)
    if code != 0:
        return {"error": f"--resume exited {code}: {tail(out, 2)}", "killed_after_lines": at}
    want, got = fingerprint(Path(f"{base}_plain")), fingerprint(killed)
    r = {"identical": want == got, "weights_identical": want[0] == got[0],
         "metrics_identical": want[1] == got[1], "killed_after_lines": at,
         "plain_seconds": plain}
    if not r["identical"] and mode == "default":
        twin = base.with_name(base.name + "_twin")
        code, _, _ = child([*cmd, *steps, f"--out_dir={twin}", "--overwrite"], report,
                           max(1, budget - (time.time() - t0)), env)
        r["plain_runs_repeat"] = code == 0 and want == fingerprint(twin)
    return r


def sigkill_after(cmd: list[str], out_dir: Path, lines: int, env: dict, timeout: float) -> int:
    """Start `cmd` and SIGKILL it once its metrics.jsonl has `lines` lines; the lines it had."""
    metrics = out_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    while p.poll() is None and time.time() - t0 < timeout:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= lines:
            break
        time.sleep(0.02)
    kill_tree(p.pid)
    p.wait()
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def fingerprint(run: Path) -> tuple[str, str]:
    """(hash of the final weights, hash of the metrics without clocks)."""
    sys.path.insert(0, str(REPO / "bench"))
    from fingerprint import digest

    metrics, weights = digest(run)
    return weights, metrics


# ------------------------------------------------------------------------------------ full, lora
def full_step(a, report: Report, cap: float) -> dict:
    sizes = ["--shape", "Qwen/Qwen2.5-1.5B", "--prompts", "16", "--group-size", "8",
             "--prompt-tokens", "512", "--max-new-tokens", "1024", "--skip-torchrun", "--profile"]
    if a.dry_run:
        sizes = [*DRY, "--max-grad-norm-diff", "0.1", "--skip-torchrun", "--profile"]
    return gpu_check(a, report, sizes, cap, "full")


def lora_step(a, report: Report, cap: float) -> dict:
    sizes = ["--shape", "Qwen/Qwen3-4B-Base", "--lora", "32", "--prompts", "8", "--group-size",
             "8", "--prompt-tokens", "512", "--max-new-tokens", "512", "--skip-torchrun"]
    if a.dry_run:
        sizes = [*DRY, "--lora", "4", "--skip-torchrun"]
    return gpu_check(a, report, sizes, cap, "lora")


# ---------------------------------------------------------------------------------------- decode
DECODE_TARGET = 10_000  # useful tokens/s at Qwen2.5-1.5B's shape, 128 rows (issue #50)


def decode_step(a, report: Report, cap: float) -> dict:
    """bench/decode_step.py at Qwen2.5-1.5B's shape, 128 rows, prompts of 256-512: decode tokens/s
    before (FSDP hooks on, HF's cache), after (hooks off, the in-place cache), packed (and
    rollout.pack_gqa: K and V never expanded per query head) and static_packed (and
    rollout.static_cache: transformers compiles the step, CUDA graphs), in one run; the op counts
    are the CPU's (--no-count here: the cap's seconds go to the arms). Passes when
    every arm ran and the best reaches DECODE_TARGET. The dry run compiles the static arm on the
    CPU (--compile-anywhere): the compiled path a GPU takes, proven first."""
    sizes = ["--shape", "1.5b", "--layers", "0", "--rows", "128", "--prompt-tokens", "512",
             "--ragged", "--tokens", "32,288", "--dtype", "bfloat16", "--device", "cuda",
             "--repeats", "1", "--arms", "before,after,packed,static_packed", "--no-count"]
    if a.dry_run:
        sizes = ["--layers", "2", "--vocab", "4096", "--rows", "4", "--ragged", "--tokens",
                 "4,12", "--repeats", "1", "--arms", "before,after,packed,static_packed",
                 "--compile-anywhere"]
    out = Path(a.work) / "decode_step.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "bench" / "decode_step.py"), *sizes, "--json", str(out)]
    code, text, _ = child(cmd, report, cap)
    if code != 0 or not out.is_file():
        return {"status": "failed", "exit": code, "tail": tail(text)}
    r = json.loads(out.read_text())
    best = max([arm["tokens_per_s"] for arm in r["arms"].values()], default=0.0)
    passed = not r["failed"] and (best >= DECODE_TARGET or a.dry_run)
    return r | {"status": "passed" if passed else "missed", "target_tokens_per_s": DECODE_TARGET}


def refill_step(a, report: Report, cap: float) -> dict:
    """bench/rollout_refill.py's static and refill_static arms at Qwen2.5-1.5B's shape (512 rows
    of up to 1,024 new tokens, mean 256, 128 slots, prompts of 512, bf16), each compiled first in
    an untimed rollout of 128 rows. Passes when both ran and the best reaches DECODE_TARGET. The
    dry run compiles both on the CPU (--compile-anywhere)."""
    sizes = ["--shape", "1.5b", "--layers", "0", "--rows", "512", "--slots", "128",
             "--max-new", "1024", "--mean-len", "256", "--prompt-tokens", "512", "--same-length",
             "--dtype", "bfloat16", "--device", "cuda", "--repeats", "1", "--no-count"]
    if a.dry_run:
        sizes = ["--layers", "2", "--rows", "8", "--group", "2", "--slots", "4",
                 "--prompt-tokens", "16", "--max-new", "24", "--mean-len", "8", "--repeats", "1",
                 "--no-count", "--compile-anywhere"]
    out = Path(a.work) / "rollout_refill.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "bench" / "rollout_refill.py"), *sizes,
           "--arms", "static,refill_static", "--json", str(out)]
    code, text, _ = child(cmd, report, cap)
    if code != 0 or not out.is_file():
        return {"status": "failed", "exit": code, "tail": tail(text)}
    r = json.loads(out.read_text())
    best = max([arm["tokens_per_s"] for arm in r["arms"].values()], default=0.0)
    passed = len(r["arms"]) == 2 and (best >= DECODE_TARGET or a.dry_run)
    return r | {"status": "passed" if passed else "missed", "target_tokens_per_s": DECODE_TARGET}


def rollout_step(a, report: Report, cap: float) -> dict:
    """A whole rollout at the `full` step's shape (Qwen2.5-1.5B, 128 rows, prompts of 512, up to
    1,024 new tokens, FSDP2 on one GPU) through rollout.generate with rollout.static_cache and
    rollout.pack_gqa (gpu_check --fast-decode: a first rollout compiles the step, the second is
    timed); the `full` step's generation is the same rollout on the default path. Useful tokens/s;
    passes when it reaches DECODE_TARGET."""
    sizes = ["--shape", "Qwen/Qwen2.5-1.5B", "--prompts", "16", "--group-size", "8",
             "--prompt-tokens", "512", "--max-new-tokens", "1024"]
    if a.dry_run:
        sizes = DRY
    flags = [*sizes, "--skip-torchrun", "--generation-only", "--fast-decode"]
    r = gpu_check(a, report, flags, cap, "rollout")
    speed = r.get("generation", {}).get("useful_tokens_per_s", 0.0)
    if r["status"] == "passed" and speed < DECODE_TARGET and not a.dry_run:
        r["status"] = "missed"
    return r | {"target_tokens_per_s": DECODE_TARGET}


STEPS = {"env": env_step, "check": check_step, "tiny": tiny_step, "resume": resume_step,
         "decode": decode_step, "refill": refill_step, "rollout": rollout_step,
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
