"""The run's folder (lock, --overwrite, atomic writes) and its checkpoints. checkpoints/step_N holds
the model, optimizer.pt (the whole optimizer state by parameter name) and per rank state_rank{r}.pt
(progress, replay buffer, RNG streams); written elsewhere and renamed, a step_N folder is complete.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint import state_dict as dcp

from config import flat_dict
from rollout import fsync, save_model
from util import MAX, all_ranks, oneline, rank_and_world

# What runs write in out_dir: a folder holding anything else is never overwritten.
RUN_FILES = {".run", ".lock", "config.yaml", "metrics.jsonl", "summary.json", "checkpoints",
             "final", "wandb", "eval"}
# Config keys (and prefixes) that may change on --resume.
RESUMABLE = ("max_steps", "threads", "out_dir", "eval.", "wandb.", "checkpoint.",
             "reward.workers", "reward.timeout", "reward.batch_budget",
             "model.gradient_checkpointing", "model.compile", "model.device",
             "optim.micro_batch_size", "optim.logprob_batch_size", "rollout.gen_batch_size",
             "rollout.vllm_")
FULL = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, rank 0's host


class RunError(Exception):
    """Bad input, or a failed read or write, found while running: one line, exit 2."""


# ------------------------------------------------------------------------------- the run's folder


def aside(out: Path) -> Path:  # where --overwrite keeps the old run until the new one has a step
    return out.with_name(f"{out.name}.overwritten")


def check_out_dir(out: Path, resume: str | None, overwrite: bool) -> None:
    """Refuse, before anything is created or deleted, an out_dir this run may not use."""
    if out.exists() and not out.is_dir():
        raise RunError(f"out_dir {out} is a file")
    names = set()
    if out.is_dir():
        names = {p.name for p in out.iterdir()} - {".lock"}
    strange = sorted(names - RUN_FILES)
    if names and (strange or not (out / ".run").is_file()):
        listed = ", ".join(strange[:3]) or "no .run marker"
        raise RunError(f"out_dir {out} holds files no run wrote ({listed}); choose another out_dir")
    if names and resume is None and not overwrite:
        raise RunError(f"out_dir {out} is not empty; "
                       "pass --resume to continue it or --overwrite to start over")
    if overwrite and aside(out).exists():
        raise RunError(f"{aside(out)} holds a run an interrupted --overwrite set aside; "
                       "move it back or delete it")


def claim_out_dir(out: Path, overwrite: bool):
    """Create out_dir, lock it, mark it as a run's; --overwrite first renames the old run aside."""
    try:
        lock = lock_folder(out)
        if overwrite and (out / ".run").exists():  # a previous run: renamed aside whole, locked
            os.replace(out, aside(out))
            lock.close()
            lock = lock_folder(out)
        if not (out / ".run").exists():
            (out / ".run").write_text(json.dumps({"created": time.time()}) + "\n")
        return lock
    except OSError as e:
        raise RunError(f"out_dir {out} is not writable: {e.strerror or e}") from None


def lock_folder(out: Path):
    """out_dir, created if need be, locked by this process (the lock dies with it)."""
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = (out / ".lock").read_text().strip() or "?"
        raise RunError(f"out_dir {out} is in use by another run (pid {pid})") from None
    lock.truncate(0)  # ("a+": the write goes to the end)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def put_back(out: Path) -> None:  # the new run failed before its first step: the old one returns
    shutil.rmtree(out)
    os.replace(aside(out), out)


def drop_aside(out: Path) -> None:  # the new run has finished a step: the old one goes
    if aside(out).is_dir():
        shutil.rmtree(aside(out))


def write_file(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically: a temporary file, fsync'ed, renamed."""
    tmp = path.with_name(f".tmp_{path.name}")
    try:
        tmp.write_text(text)
        fsync(tmp)
    except OSError:
        tmp.unlink(missing_ok=True)  # left behind, it would make out_dir look like no run's
        raise
    os.replace(tmp, path)
    fsync(path.parent)


# ------------------------------------------------------------------------------- checkpoints


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return sorted(p for p in (out / "checkpoints").glob("step_*") if p.is_dir())


def intact(out: Path) -> str:
    """What a failed write (a full disk) leaves to resume from."""
    found = checkpoints(out)
    if found:
        return f"{found[-1]} is intact: free space, then --resume"
    return "no checkpoint is intact"


def save_checkpoint(out: Path, cfg, model, tokenizer, optimizer, replay, progress: dict) -> None:
    """checkpoints/step_N of the step in `progress`; all but the last checkpoint.keep_last go."""
    rank, world = rank_and_world()
    state = {"replay": replay.state_dict(), "rng": rng_state(), "world": world,
             "run": {**progress, "config": flat_dict(cfg)}}
    folder = out / "checkpoints" / f"step_{progress['step']:06d}"
    save_model(model, tokenizer, folder, state, optimizer_state(model, optimizer))
    if rank == 0:
        for old in checkpoints(out)[: -cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def optimizer_state(model, optimizer) -> dict | None:
    """The whole state by parameter name on rank 0 ({} on the others); None before the first step
    (torch's helper would take a zero step to create it, shifting AdamW's bias correction)."""
    if not all_ranks(float(bool(optimizer.state)), MAX):
        return None
    return dcp.get_optimizer_state_dict(model, optimizer, options=FULL)


def load_optimizer(ck: Path, model, optimizer) -> None:
    """optimizer.pt, read by rank 0; torch's helper sends every rank its part (FSDP: its shards)."""
    if not (ck / "optimizer.pt").is_file():  # saved before the first optimizer step
        return
    full, error = {}, ""
    if rank_and_world()[0] == 0:
        try:
            full = torch.load(ck / "optimizer.pt", weights_only=True)
        except Exception as e:  # truncated, empty or foreign: refused on every rank
            error = f"{type(e).__name__}: {oneline(e, 120)}"
    if all_ranks(float(bool(error)), MAX):
        raise RunError(f"checkpoint {ck.name}: optimizer.pt is damaged ({error or 'on rank 0'})")
    options = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    dcp.set_optimizer_state_dict(model, optimizer, optim_state_dict=full, options=options)


def read_state(ck: Path, rank: int) -> dict:
    """This rank's trainer state (rank 0's for a new rank), the weights checked whole."""
    try:
        state = torch.load(ck / "state_rank0.pt", weights_only=True)
        if 0 < rank < state["world"]:
            state = torch.load(ck / f"state_rank{rank}.pt", weights_only=True)
        if not {"rng", "replay", "world", "run"} <= set(state):
            raise ValueError("trainer state without its keys")
        for f in sorted(ck.glob("*.safetensors")) or [ck / "model.safetensors"]:
            with safe_open(f, "pt") as st:  # a truncated file fails: its header promises more
                list(st.keys())
        return state
    except pickle.UnpicklingError:
        raise RunError(f"checkpoint {ck.name}: holds objects other than tensors and plain values; "
                       "refusing to unpickle them") from None
    except Exception as e:  # missing, truncated, empty or foreign: all "damaged"
        what = f"{type(e).__name__}: {oneline(e, 120)}"
        raise RunError(f"checkpoint {ck.name} is damaged ({what})") from None


def find_checkpoint(out: Path, which: str, rank: int) -> tuple[Path, dict]:
    """The checkpoint to resume ("": the newest, or a step_N name) and this rank's state. A damaged
    one names the newest before it: renamed into place whole, it is intact."""
    found = checkpoints(out)
    if not found:
        raise RunError(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
    ck = out / "checkpoints" / which if which else found[-1]
    try:
        return ck, read_state(ck, rank)
    except RunError as e:
        older = [p.name for p in found if p.name < ck.name]
        if not older:
            raise RunError(f"{e}; no older checkpoint is intact") from None
        raise RunError(f"{e}; the newest intact one is {older[-1]}: --resume={older[-1]}") from None


def restore(ck: Path, state: dict, cfg, model, optimizer, replay, progress: dict) -> None:
    """Optimizer, buffer, RNG streams and `progress` (in place) from `ck` (weights: loaded already).
    Saved by another number of processes: the buffers are merged and re-split, and the RNG streams
    restart from (seed, rank, step): the same state, sampled from differently."""
    rank, world = rank_and_world()
    saved = state["run"]["config"]
    step = state["run"]["step"]
    changed = sorted(k for k, v in flat_dict(cfg).items() if k in saved and saved[k] != v)
    refused = [k for k in changed if not k.startswith(RESUMABLE)]
    if refused:
        raise RunError(f"--resume: {', '.join(refused)} differ from the checkpoint's "
                       "and change what its state means")
    if cfg.max_steps < step:
        raise RunError(f"--resume: max_steps ({cfg.max_steps}) is below the checkpoint's step "
                       f"({step})")
    seed = cfg.seed + 7919 * step  # a new stream per step; ranks apart as at the start (+ rank)
    try:
        load_optimizer(ck, model, optimizer)
        if state["world"] == world:
            replay.load_state_dict(state["replay"])
        else:
            files = [ck / f"state_rank{i}.pt" for i in range(state["world"])]
            parts = [torch.load(f, weights_only=True)["replay"] for f in files]
            replay.load_split(parts, rank, world, seed + rank)
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        raise RunError(f"checkpoint {ck.name} does not fit this run ({oneline(e, 200)})") from None
    if state["world"] == world:
        set_rng_state(state["rng"])
    else:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed + rank)
    progress.update((k, v) for k, v in state["run"].items() if k != "config")
    if rank == 0:
        note = f"; changed: {', '.join(changed)}" if changed else ""
        if state["world"] != world:
            note += f"; saved by {state['world']} processes: buffers re-split, RNG reseeded"
        print(f"resuming from {ck} (step {step}){note}", file=sys.stderr)


def rng_state() -> dict:
    """Every global RNG as lists and tensors, so the checkpoint loads with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
