"""The 3-step fingerprint of the training path: metrics (times left out) and final weights of short
runs of every configs/tiny arm, and of engine=vllm, LoRA, and ddp / fsdp under torchrun. A refactor
must leave every line of its output unchanged.

  python bench/fingerprint.py > before.txt          # every case
  python bench/fingerprint.py none aper ddp         # some of them
  python bench/fingerprint.py --list

Each case runs train.py in a subprocess (one thread, wandb off, a 16-problem eval) into a temporary
folder and prints `case  sha256(metrics)  sha256(final weights)`. The vllm case needs vLLM
(requirements-vllm.txt); without it the line says so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import cli

SHORT = ["--max_steps=3", "--eval.n=16", "--eval.every=2", "--checkpoint.every=0", "--threads=1",
         "--wandb.mode=disabled"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
VARY = ("time/", "wall", "reward/verify_seconds", "reward/worker_frac")  # clocks, not maths
# Counters added after the fingerprints were pinned (#47: the update's token passes; #60: the greedy
# eval, outside the run's RNG); they change no number the run computes, and tests check them.
ADDED = ("tokens/fwd_bwd", "tokens/no_grad", "eval/greedy")
# Keys older code logged with a constant where they meant nothing, removed since (#57: a gate's
# lm_head ratio of 0.0 in SFPO's and GXPO's lines, whose passes no gate measures): a row's key
# with exactly this value is left out of the digest; a measured value still counts.
RETIRED = {"optim/lm_head_grad_ratio_max": 0.0}
SMALL = ["--rollout.batch_size=32", "--rollout.group_size=4"]


def cases() -> dict[str, tuple[list[str], list[str]]]:
    """{name: (launcher, config arguments)}: each configs/tiny arm, then the engines and worlds."""
    out = {}
    for yaml in sorted((ROOT / "configs" / "tiny").glob("*.yaml")):
        if yaml.stem != "common":
            out[yaml.stem] = ([], ["--config", str(yaml)])
    tiny = ["--config", str(ROOT / "configs" / "tiny" / "aper.yaml")]
    out["vllm"] = ([], tiny + SMALL + ["--rollout.engine=vllm"])
    refill = ["--rollout.refill=true", "--rollout.gen_batch_size=8", "--rollout.sync_every=3"]
    out["refill"] = ([], tiny + SMALL + refill)
    out["ddp"] = (TORCHRUN, tiny + SMALL)
    out["fsdp"] = (TORCHRUN, tiny + SMALL + ["--model.parallel=fsdp"])
    lora = ["--config", str(ROOT / "configs" / "tiny" / "lora.yaml")]
    out["lora_fsdp"] = (TORCHRUN, lora + SMALL + ["--model.parallel=fsdp"])
    return out


def digest(out: Path) -> tuple[str, str]:
    """sha256 of the metrics lines without times, and of every final tensor by name."""
    h = hashlib.sha256()
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        kept = {}
        for k, v in row.items():
            if k.startswith(VARY) or k in ADDED or RETIRED.get(k, math.nan) == v:
                continue
            kept[k] = v
        h.update(json.dumps(kept, sort_keys=True).encode())
    w = hashlib.sha256()
    for f in sorted((out / "final").glob("*.safetensors")):
        tensors = load_file(f)
        for name in sorted(tensors):
            w.update(name.encode())
            w.update(tensors[name].float().numpy().tobytes())
    return h.hexdigest()[:16], w.hexdigest()[:16]


def run(name: str, launcher: list[str], args: list[str]) -> str:
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        return f"{name:12s} skipped (vLLM not installed)"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / name
        cmd = (launcher or [sys.executable]) + [str(ROOT / "train.py"), *args, *SHORT,
                                                f"--out_dir={out}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            return f"{name:12s} FAILED {done.returncode}: {done.stderr.strip()[-300:]}"
        metrics, weights = digest(out)
        return f"{name:12s} {metrics} {weights}"


def main(argv: list[str]) -> int:
    known = cases()
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("cases", nargs="*", help="the cases to run (default: every case)")
    ap.add_argument("--list", action="store_true", help="name every case")
    a = ap.parse_args(argv)
    if a.list:
        print("\n".join(known))
        return 0
    unknown = [name for name in a.cases if name not in known]
    if unknown:
        ap.error(f"unknown case {unknown[0]} (--list names them)")
    for name in a.cases or known:
        print(run(name, *known[name]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
