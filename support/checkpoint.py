"""A run's checkpoints and its end. checkpoints/step_N holds the model, optimizer.pt (the whole
optimizer state by parameter name), per rank state_rank{r}.pt (progress, replay buffer, RNG streams)
and manifest.json (every file with its size, written last); written elsewhere and renamed, a step_N
folder is whole, and --resume refuses one that is not (support/integrity.py). The run's folder
itself (lock, --overwrite, the log) is support/rundir.py's.
"""

from __future__ import annotations

import pickle
import random
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint import state_dict as dcp

from support import integrity, replay_state
from support.models import save_model
from support.parallel import MAX, all_ranks, rank_and_world
from support.preempt import rng_state, set_rng_state
from support.util import RunError, flat_dict, oneline, stderr_line

# Config keys (and prefixes) that may change on --resume.
RESUMABLE = ("max_steps", "threads", "out_dir", "eval.", "wandb.", "checkpoint.",
             "reward.workers", "reward.timeout", "reward.batch_budget",
             "model.gradient_checkpointing", "model.compile", "model.device",
             "optim.micro_batch_size", "optim.logprob_batch_size", "rollout.gen_batch_size",
             "rollout.vllm_")
FULL = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, rank 0's host


@dataclass
class CheckpointConfig:
    every: int = 50
    """A resumable checkpoint every N steps and after the last (0 = none: the final model only)."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted after a new one is complete."""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"every": (self.every >= 0, "≥ 0 (0 = off)"),
                "keep_last": (self.keep_last >= 1, "≥ 1")}


def stopped(out: Path, progress, signum: int) -> None:
    """After a stop (SIGTERM, SIGINT): one note on stderr saying where --resume continues."""
    last = checkpoints(out)
    where = f"--resume continues from {last[-1].name}" if last else "no checkpoint yet"
    if progress.pending_row and signum == signal.SIGTERM:
        where += f" (with the eval of step {progress.step}, cut short)"
    name = signal.Signals(signum).name
    stderr_line(f"\nstopped by {name} after step {progress.step}; {where}")  # (every rank's)


def saved_at(out: Path, step: int) -> bool:
    """Whether the newest checkpoint is of `step`."""
    last = checkpoints(out)
    return bool(last) and last[-1].name == f"step_{step:06d}"


# summary.json's step-0 evals: its key for each of the eval's figures
INITIAL_EVALS = {"eval_accuracy_initial": "accuracy", "eval_pass_at_k_initial": "pass@k",
                 "eval_maj_at_k_initial": "maj@k", "eval_greedy_initial": "greedy"}


def summary(cfg, p) -> dict:
    """summary.json of a finished run (`p`: train.Progress): its settings, first and last evals,
    counts and versions."""
    initial = {key: p.eval_initial.get(name) for key, name in INITIAL_EVALS.items()}
    return {"strategy": cfg.replay.strategy, "seed": cfg.seed, "steps": cfg.max_steps,
            **initial,
            "eval_accuracy_final": p.eval_last.get("accuracy"),
            "eval_response_len_final": p.eval_last.get("response_len"),
            "eval_entropy_final": p.eval_last.get("entropy"),
            "eval_pass_at_k_final": p.eval_last.get("pass@k"),
            "eval_maj_at_k_final": p.eval_last.get("maj@k"),
            "eval_greedy_final": p.eval_last.get("greedy"),
            "generated_tokens": p.generated_tokens,
            "tokens_trained": p.trained_tokens,
            "rows_trained": p.trained_rows,
            "tokens_fwd_bwd": p.fwd_bwd_tokens,
            "tokens_no_grad": p.no_grad_tokens,
            "versions": p.versions,
            "tokens_generated_total": p.generated_tokens + p.source_tokens,
            "wall_seconds": p.wall,
            "skipped_updates": p.skipped}


def kept_summary(run: Path, summary: dict) -> dict:
    """`summary` (the summary.json of the finished run in `run`) with the step-0 evals it lacks
    read from the progress its newest checkpoint saved (read_state: checked whole, a damaged one a
    RunError) and "eval_initial_from" naming that checkpoint (code before 4f03516 wrote step 0's
    accuracy alone); as it is when none lacks or no checkpoint is left."""
    missing = [key for key in INITIAL_EVALS if key not in summary]
    found = checkpoints(run)
    if not missing or not found:
        return summary
    saved = read_state(found[-1], 0)["run"]["eval_initial"]
    restored = {key: saved.get(INITIAL_EVALS[key]) for key in missing}
    where = str((found[-1] / "state_rank0.pt").relative_to(run))
    return summary | restored | {"eval_initial_from": where}


def failure(e: BaseException, out: Path, step: int) -> RunError | None:
    """The one line a failed run ends with, naming where to resume: a failed write (a full disk),
    non-finite weights (an lr too high). None for anything else (a bug: its traceback)."""
    if isinstance(e, OSError):
        return RunError(f"{oneline(e)}; {intact(out)}")
    if not isinstance(e, FloatingPointError):
        return None
    last = checkpoints(out)
    good = f"{last[-1].name}: --resume={last[-1].name} with a lower lr" if last else "none"
    return RunError(f"{e} at step {step + 1} (optim.lr too high?); the last good checkpoint is "
                    f"{good}")


# ------------------------------------------------------------------------------- checkpoints


class OlderLayout(RunError):
    """A checkpoint of older code, refused as such (not as damaged)."""


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return sorted(p for p in (out / "checkpoints").glob("step_*") if p.is_dir())


def intact(out: Path) -> str:
    """What a failed write (a full disk) leaves to resume from."""
    found = checkpoints(out)
    if found:
        return f"{found[-1]} is intact: free space, then --resume"
    return "no checkpoint is intact"


def save_checkpoint(out: Path, cfg, model, tokenizer, optimizer, replay, progress,
                    extra: dict | None = None) -> None:
    """checkpoints/step_N of the step in `progress`; all but the last checkpoint.keep_last go.
    `extra`: {name: object with state_dict()} saved beside the buffer (prompt skipping, stages)."""
    rank, world = rank_and_world()
    state = {"replay": replay.state_dict(), "rng": rng_state(), "world": world,
             "run": {**asdict(progress), "config": flat_dict(cfg)}}
    for name, obj in (extra or {}).items():
        state[name] = obj.state_dict()
    folder = out / "checkpoints" / f"step_{progress.step:06d}"
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
    for p, kept in optimizer.state.items():  # a state of another shape fails at the next step
        wrong = [k for k, v in kept.items()
                 if torch.is_tensor(v) and v.dim() and v.shape != p.shape]
        if wrong:
            raise RunError(f"checkpoint {ck.name}: optimizer.pt's {wrong[0]} is of shape "
                           f"{tuple(kept[wrong[0]].shape)}, its parameter {tuple(p.shape)}")


def read_state(ck: Path, rank: int) -> dict:
    """This rank's trainer state (rank 0's for a new rank), the folder checked whole first (its
    manifest), then the state's fields and the weights' headers. A folder its manifest does not
    vouch for is refused: as older code's when its state says so, else as damaged."""
    fault = integrity.manifest_fault(ck)  # every file's sha256, before one is used
    older = integrity.older_layout(ck)
    if older is None:
        try:  # (weights_only: reading a state the manifest does not vouch for runs no code)
            state = torch.load(ck / "state_rank0.pt", weights_only=True)
            world = state.get("world") if isinstance(state, dict) else None
            if type(world) is int and 0 < rank < world:
                state = torch.load(ck / f"state_rank{rank}.pt", weights_only=True)
            older = integrity.older_layout(ck, state)
            fault = fault or integrity.state_fault(state, ck)
            for f in sorted(ck.glob("*.safetensors")) or [ck / "model.safetensors"]:
                with safe_open(f, "pt") as st:  # a truncated file fails: its header promises more
                    list(st.keys())
        except pickle.UnpicklingError:
            raise RunError(f"checkpoint {ck.name}: holds objects other than tensors and plain "
                           "values; refusing to unpickle them") from None
        except Exception as e:  # missing, truncated, empty or foreign: all "damaged"
            fault = fault or f"{type(e).__name__}: {oneline(e, 120)}"
    if older:
        raise OlderLayout(f"checkpoint {ck.name} is of an older layout ({older}), which this code "
                          f"does not resume: start a new run from its weights (--model.path={ck}) "
                          "in another out_dir")
    if fault:
        raise RunError(f"checkpoint {ck.name} is damaged ({fault})")
    return state


def find_checkpoint(out: Path, which: str, rank: int) -> tuple[Path, dict]:
    """The checkpoint to resume ("": the newest, or a step_N name) and this rank's state. A damaged
    one names the newest before it that its manifest says is whole."""
    found = checkpoints(out)
    if not found:
        raise RunError(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
    ck = out / "checkpoints" / which if which else found[-1]
    try:
        state = read_state(ck, rank)
    except OlderLayout:  # (the older ones are of it too)
        raise
    except RunError as e:
        older = [p.name for p in found if p.name < ck.name and not integrity.manifest_fault(p)]
        if not older:
            raise RunError(f"{e}; no older checkpoint is intact") from None
        raise RunError(f"{e}; the newest intact one is {older[-1]}: --resume={older[-1]}") from None
    # A disk that cannot hold the next checkpoint is refused now, alone, not after a resume note
    # and the steps up to that checkpoint.
    size = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
    free = shutil.disk_usage(ck).free
    if free < size:
        raise RunError(f"--resume: {free:,} bytes free on the disk of {out}, fewer than the "
                       f"{size:,} of {ck.name} that the next checkpoint needs: free space, then "
                       "--resume")
    return ck, state


def restore(ck: Path, state: dict, cfg, model, optimizer, replay, progress,
            extra: dict | None = None) -> tuple[str, dict]:
    """Optimizer, buffer, RNG streams and the methods in `extra` from `ck` (weights: loaded
    already); `progress` (the new run's) is read, not written. Saved by another number of
    processes: the buffers are merged and re-split, and the RNG streams restart from (seed, rank,
    step): the same state, sampled from differently. Returns the note train.py prints once set-up
    has succeeded, and the saved progress for train.py to take."""
    rank, world = rank_and_world()
    saved = state["run"]["config"]
    step = state["run"]["step"]
    # A run saves the state of each method that is on (`extra`: skip, stages, lookahead), with
    # the config that turns it on: one missing would restart its state in the middle of the run.
    for name in extra or {}:
        if name not in state and any(k.startswith(f"{name}.") for k in saved):
            raise RunError(f"checkpoint {ck.name} is damaged (its trainer state holds no {name} "
                           f"state, which its run saved with its {name}.* settings)")
    changed = sorted(k for k, v in flat_dict(cfg).items() if k in saved and saved[k] != v)
    refused = [k for k in changed if not k.startswith(RESUMABLE)]
    if refused:
        raise RunError(f"--resume: {', '.join(refused)} differ from the checkpoint's "
                       "and change what its state means")
    data = state["run"].get("data_sha256")  # (None: a checkpoint of older code)
    if data is not None and data != progress.data_sha256:
        raise RunError(f"--resume: the training data ({cfg.data.train}) is not what checkpoint "
                       f"{ck.name} was trained on (the problems' sha256 differ): restore the "
                       "file, or start a new run (another out_dir, or --overwrite)")
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
            replay_state.load_split(replay, parts, rank, world, seed + rank)
        for name, obj in (extra or {}).items():  # SHARED: the same on every rank
            if name in state and (state["world"] == world or getattr(obj, "SHARED", False)):
                obj.load_state_dict(state[name])
        if state["world"] == world:
            set_rng_state(state["rng"])
    except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as e:
        raise RunError(f"checkpoint {ck.name} does not fit this run ({oneline(e, 200)})") from None
    if state["world"] != world:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed + rank)
    saved_progress = {k: v for k, v in state["run"].items() if k != "config"}
    note = f"; changed: {', '.join(changed)}" if changed else ""
    if state["world"] != world:
        note += f"; saved by {state['world']} processes: buffers re-split, RNG reseeded"
    return f"resuming from {ck} (step {step}){note}", saved_progress
