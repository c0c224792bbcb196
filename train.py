"""GRPO with experience replay, in one flat loop.

Usage:
  python train.py --config configs/tiny.yaml --out_dir=runs/tiny                 # embedded model + task, CPU
  python train.py --config configs/tiny.yaml --replay.strategy=aper --seed=1      # flip one key
  python train.py --config configs/tiny.yaml --out_dir=runs/tiny --resume         # continue after a kill or a stop
  torchrun --nproc_per_node=8 train.py --config configs/papers/rlep_qwen25_math_7b.yaml --out_dir=runs/rlep

Flags: --config FILE; --resume (newest checkpoint in out_dir) or --resume=step_000040; --overwrite (start over in a
run's out_dir: the old run is removed once the new one has finished a step); --debug (tracebacks). Everything else
is a dotted config override (config.py).

One step: rollout (HF generate, G samples per prompt, behaviour log-probs kept) → reward (rewards.py, plus DAPO's
overlong shaping when on) → advantages (grpo.py; RLEP first appends stored successes to each group) → replay
sample → update on fresh ∪ replayed rows (grpo.update_policy) → replay push → log → eval → checkpoint.

Safety: bad input is one line and exit 2, found before anything is created or deleted. out_dir is locked and marked
as a run's, so --overwrite removes only what a run wrote. Checkpoints go to a temporary folder, are fsync'ed and
renamed into place. SIGTERM (preemption) checkpoints and exits 143; SIGINT exits 130.

Several processes (torchrun): each rank generates for its share of the step's prompts and keeps its own replay
buffer; model.parallel=ddp replicates the model, fsdp (FSDP2) shards it. Loss normalisers are global totals, so
every rank applies the whole batch's update. Rank 0 logs and writes the model; each rank writes its trainer state.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import grpo
from config import Config, ConfigError, flat_dict, load_config, save_config, validate
from data.loaders import load_task
from eval import evaluate, summarize
from grpo import all_ranks, timed
from replay import make_replay
from rewards import overlong_penalty, score_batch
from rollout import Rollouts, build_prompts, end_ids, full_weights, generate, load_policy

RUN_FILES = {".run", ".lock", ".overwritten", "config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "final",
             "wandb", "eval"}  # what runs write in out_dir: all --overwrite may move away
RESUMABLE = ("max_steps", "threads", "out_dir", "eval.", "wandb.", "checkpoint.", "reward.workers", "reward.timeout",
             "reward.batch_budget", "model.gradient_checkpointing", "model.compile", "model.device",
             "optim.micro_batch_size", "optim.logprob_batch_size", "rollout.gen_batch_size")  # may change on --resume


class RunError(Exception):
    """Bad input, or a failed read or write, found while running: one line, exit 2."""


def main(argv: list[str]) -> int:
    flags = {a.split("=")[0]: a.partition("=")[2] for a in argv if a.split("=")[0] in ("--resume", "--overwrite", "--debug")}
    rest = [a for a in argv if a.split("=")[0] not in flags]
    config_path, i = None, 0
    while i < len(rest):  # --config FILE or --config=FILE; the last one wins
        if rest[i] == "--config" or rest[i].startswith("--config="):
            config_path = rest[i][9:] if "=" in rest[i] else (rest[i + 1] if i + 1 < len(rest) else "")
            rest = rest[:i] + rest[i + (1 if "=" in rest[i] else 2):]
        else:
            i += 1
    try:
        if config_path == "":
            raise ConfigError("--config needs a file")
        cfg = load_config(config_path, rest)
        validate(cfg)
        if "--resume" in flags and "--overwrite" in flags:
            raise ConfigError("--resume and --overwrite exclude each other")
        return train(cfg, resume=flags.get("--resume"), overwrite="--overwrite" in flags)
    except (ConfigError, RunError) as e:  # bad input; any other exception is a bug and keeps its traceback
        if "--debug" in flags:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


# ------------------------------------------------------------------------------------------ the run's folder


def check_out_dir(out: Path, resume: str | None, overwrite: bool) -> None:
    """Refuse, before anything is created or deleted, an out_dir this run may not use."""
    if out.exists() and not out.is_dir():
        raise RunError(f"out_dir {out} is a file")
    names = {p.name for p in out.iterdir()} - {".lock"} if out.is_dir() else set()
    if names and (not (out / ".run").is_file() or names - RUN_FILES):
        strange = sorted(names - RUN_FILES)[:3] or ["no .run marker"]
        raise RunError(f"out_dir {out} holds files no run wrote ({', '.join(strange)}); choose another out_dir")
    if names and resume is None and not overwrite:
        raise RunError(f"out_dir {out} is not empty; pass --resume to continue it or --overwrite to start over")
    if overwrite and (out / ".overwritten").exists():
        raise RunError(f"out_dir {out}/.overwritten holds a run an interrupted --overwrite set aside; move it back "
                       "or delete it first")


def claim_out_dir(out: Path, overwrite: bool):
    """Create out_dir, lock it against a second run (the lock dies with the process), mark it as a run's, and set
    an overwritten run aside in .overwritten/ (deleted after the new run's first step, put back if it fails)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / ".lock", "a+")  # noqa: SIM115 -- held for the whole run
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise RunError(f"out_dir {out} is in use by another run (pid {lock.read().strip() or '?'})") from None
        lock.seek(0), lock.truncate(), lock.write(f"{os.getpid()}\n"), lock.flush()
        moved = [p for p in out.iterdir() if p.name in RUN_FILES - {".run", ".lock", ".overwritten"}] if overwrite else []
        if moved:
            (out / ".overwritten").mkdir()
            for p in moved:
                os.replace(p, out / ".overwritten" / p.name)
        if not (out / ".run").exists():
            (out / ".run").write_text(json.dumps({"created": time.time(), "pid": os.getpid()}) + "\n")
        return lock
    except OSError as e:
        raise RunError(f"out_dir {out} is not writable: {e.strerror or e}") from None


def restore_overwritten(out: Path) -> None:
    """The run started with --overwrite failed before its first step: put the old run back."""
    for p in out.iterdir():
        if p.name in RUN_FILES - {".run", ".lock", ".overwritten"}:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for p in (out / ".overwritten").iterdir():
        os.replace(p, out / p.name)
    (out / ".overwritten").rmdir()


def write_file(path: Path, text: str) -> None:
    """Write `text` to `path` atomically: a temporary file, fsync'ed, renamed over `path`, the folder fsync'ed."""
    tmp = path.with_name(f".tmp_{path.name}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunError(f"{path} could not be written ({e.strerror or e}); the previous version is intact") from None


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------ checkpoints


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first: a folder is named step_N only once everything in it is on disk."""
    return sorted(p for p in (out / "checkpoints").glob("step_*") if p.is_dir())


def save_model(model, tokenizer, folder: Path, state: dict | None = None) -> None:
    """Write an HF model folder (float32 weights as safetensors, gathered from FSDP shards; the tokenizer) and this
    rank's trainer state into a temporary folder, fsync every file, then rename it to `folder`. Every rank calls it.
    A failure on any rank (a full disk raises OSError, SafetensorError or RuntimeError alike) removes the temporary
    folder and is one RunError naming what is intact."""
    rank, tmp, error = dist.get_rank() if dist.is_initialized() else 0, folder.with_name(f".tmp_{folder.name}"), ""
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier() if dist.is_initialized() else None
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            weights = model.state_dict()
        if rank == 0:
            model.save_pretrained(tmp, state_dict=weights)
            tokenizer.save_pretrained(tmp)
        if state is not None:
            torch.save(state, tmp / f"state_rank{rank}.pt")
        for f in tmp.iterdir():
            fsync(f)
    except Exception as e:  # noqa: BLE001 -- reported below, on every rank
        error = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    if all_ranks(float(bool(error)), dist.ReduceOp.MAX if dist.is_initialized() else None):
        shutil.rmtree(tmp, ignore_errors=True) if rank == 0 else None
        intact = checkpoints(folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent)
        raise RunError(f"{folder} could not be written ({error or 'on another rank'}); "
                       + (f"{intact[-1]} is intact: free space, then --resume" if intact else "no checkpoint is intact"))
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)  # only there when a resumed run redoes its last step
        os.replace(tmp, folder)
        fsync(folder.parent)
    dist.barrier() if dist.is_initialized() else None


def save_checkpoint(r: Run) -> None:
    """checkpoints/step_N: the model, and per rank its replay buffer, RNG streams, the run's progress and its optimizer
    state (FSDP: its own shards; otherwise rank 0 alone, the state being the same on every rank)."""
    opt = None
    if r.rank == 0 or r.sharded:
        opt = r.optimizer.state_dict()  # FSDP's DTensor shards as plain local tensors: the file loads weights_only
        opt["state"] = {k: {n: v.to_local() if isinstance(v, DTensor) else v for n, v in s.items()}
                        for k, s in opt["state"].items()}
    state = {"replay": r.replay.state_dict(), "rng": rng_state(), "optimizer": opt, "world": r.world,
             "run": {**r.progress, "config": flat_dict(r.cfg)}}
    step = r.progress["step"]
    save_model(r.model, r.tokenizer, r.out / "checkpoints" / f"step_{step:06d}", state)
    if r.rank == 0:
        for old in checkpoints(r.out)[: -r.cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(out: Path, which: str, rank: int) -> tuple[Path, dict]:
    """The checkpoint to resume ("" = the newest, else a step_N name) and this rank's trainer state. A damaged one is
    one line naming the newest intact checkpoint before it."""
    found = checkpoints(out)
    if not found:
        hint = "; an interrupted --overwrite left the previous run in .overwritten/" if (out / ".overwritten").is_dir() else ""
        raise RunError(f"--resume: no complete checkpoint in {out / 'checkpoints'}{hint}")
    ck = out / "checkpoints" / which if which else found[-1]
    try:
        return ck, read_state(ck, rank)
    except RunError as e:
        older = [p for p in found if p.name < ck.name and readable(p, rank)]
        raise RunError(f"{e}; " + (f"the newest intact one is {older[-1].name}: --resume={older[-1].name}"
                                   if older else "no older checkpoint is intact")) from None


def read_state(ck: Path, rank: int) -> dict:
    """This rank's trainer state from checkpoint `ck`, after checking that its weights file is whole."""
    from safetensors import safe_open

    try:
        state = torch.load(ck / f"state_rank{rank}.pt", weights_only=True)  # tensors and plain values only
        if not isinstance(state, dict) or not {"rng", "replay", "world", "run"} <= set(state):
            raise ValueError("trainer state without its keys")
        for f in sorted(ck.glob("*.safetensors")) or [ck / "model.safetensors"]:
            with safe_open(f, "pt") as st:  # a truncated file fails here: its header promises more than is there
                list(st.keys())
        return state
    except pickle.UnpicklingError:
        raise RunError(f"checkpoint {ck.name}: holds objects other than tensors and plain values; refusing to unpickle "
                       "them") from None
    except Exception as e:  # noqa: BLE001 -- missing, truncated, empty or foreign: all "damaged"
        raise RunError(f"checkpoint {ck.name} is damaged ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None


def readable(ck: Path, rank: int) -> bool:
    try:
        return bool(read_state(ck, rank))
    except RunError:
        return False


def restore(r: Run, ck: Path, state: dict) -> None:
    """Continue the run saved in `ck`: optimizer, replay buffer, RNG streams (the weights were loaded from `ck`)."""
    opt = state["optimizer"] if r.sharded else read_state(ck, 0)["optimizer"] if r.rank else state["optimizer"]
    if state["world"] != r.world:
        raise RunError(f"checkpoint {ck.name} was written by {state['world']} processes; resume it with as many")
    try:
        r.optimizer.load_state_dict(opt)
        for p, s in r.optimizer.state.items():  # back to DTensor shards under FSDP
            for n, v in s.items():
                if isinstance(p, DTensor) and v.dim() > 0 and not isinstance(v, DTensor):
                    s[n] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        r.replay.load_state_dict(state["replay"])
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        raise RunError(f"checkpoint {ck.name} does not fit this run ({' '.join(str(e).split())[:200]})") from None
    set_rng_state(state["rng"])


def check_resume_config(cfg: Config, saved: dict, step: int) -> list[str]:
    """Refuse changed keys that change the meaning of the saved state; return the harmless ones that changed."""
    changed = sorted(k for k, v in flat_dict(cfg).items() if k in saved and saved[k] != v)
    refused = [k for k in changed if not k.startswith(RESUMABLE)]
    if refused:
        raise RunError(f"--resume: {', '.join(refused)} differ from the checkpoint's and change what its state means; "
                       "set them back or start a new run")
    if cfg.max_steps < step:
        raise RunError(f"--resume: max_steps ({cfg.max_steps}) is below the checkpoint's step ({step})")
    return changed


# ------------------------------------------------------------------------------------------------ small helpers


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate of generation step `step` (0-based): linear warm-up, then constant or cosine decay."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, cfg.max_steps - o.warmup_steps))
    cosine = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return o.lr * (cosine if o.schedule == "cosine" else 1.0)


def prompt_order(n: int, position: int, count: int, seed: int) -> list[int]:
    """Indices of the next `count` training problems: a fresh seeded permutation each epoch. A pure function of the
    position, so resuming only needs the position."""
    out = []
    while len(out) < count:
        epoch, offset = divmod(position, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        take = perm[offset : offset + count - len(out)]
        out, position = out + take, position + len(take)
    return out


def rng_state() -> dict:
    """Every global RNG as tuples, lists and tensors: the checkpoint then loads with torch.load(weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    s = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss], "torch": torch.get_rng_state()}
    return s | ({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


class StopSignal:
    """SIGTERM / SIGINT ask the loop to stop at its next safe point; a second signal stops at once."""

    def __init__(self):
        self.signum = 0
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self)

    def __call__(self, signum, frame):
        if self.signum:
            print(f"\nerror: {signal.Signals(signum).name} again: stopping now, without a checkpoint", file=sys.stderr)
            os._exit(128 + signum)
        self.signum = signum

    def agreed(self) -> int:  # every rank stops at the same point
        return int(all_ranks(self.signum, dist.ReduceOp.MAX if dist.is_initialized() else None))


# ---------------------------------------------------------------------------------------------------- the run


@dataclass
class Run:
    """What set-up builds and the loop uses."""

    cfg: Config
    out: Path
    rank: int
    world: int
    device: torch.device
    model: torch.nn.Module  # the HF module: generation, no-grad passes, saving (FSDP-sharded in place)
    policy: torch.nn.Module  # what the training forward goes through: the model, compiled, or DDP-wrapped
    tokenizer: object
    ref: torch.nn.Module | None
    compute: object  # bf16 autocast context, or a null context
    optimizer: torch.optim.Optimizer
    replay: object
    prompts: list  # token ids of each training prompt
    golds: list
    eval_prompts: list
    eval_golds: list
    stop: list  # token ids that end a completion
    sharded: bool
    progress: dict = field(default_factory=lambda: {  # saved in checkpoints; all a resume needs besides the states
        "step": 0, "data_pos": 0, "generated_tokens": 0, "source_tokens": 0, "trained_tokens": 0, "wall": 0.0,
        "skipped": {"nonfinite": 0, "zero_adv": 0}, "wandb_id": None, "eval_initial": {}, "eval_last": {}})
    log: object = None  # metrics.jsonl, open for appending (rank 0)
    lock: object = None  # out_dir/.lock, flock'ed while the run lives (rank 0)
    wandb: object = None


def setup(cfg: Config, resume: str | None, overwrite: bool) -> Run:
    """Check everything, load data and model, restore a checkpoint, and only then claim out_dir."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(hours=2))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out, n_prompts = Path(cfg.out_dir), cfg.rollout.batch_size // cfg.rollout.group_size
    check_out_dir(out, resume, overwrite)
    if n_prompts % world:
        raise RunError(f"prompts per step ({n_prompts}) must be divisible by the number of processes ({world})")
    ck, state = find_checkpoint(out, resume, rank) if resume is not None else (None, {})
    if rank == 0 and ck is not None:
        changed = check_resume_config(cfg, state["run"]["config"], state["run"]["step"])
        print(f"resuming from {ck} (step {state['run']['step']})" + (f"; changed: {', '.join(changed)}" * bool(changed)),
              file=sys.stderr)
    torch.set_num_threads(cfg.threads) if cfg.threads else None
    random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed + rank)  # ranks sample differently
    try:  # data before the model: a bad file fails fast
        problems, eval_problems = load_task(cfg.data, cfg.eval.n)
    except (ValueError, TypeError, OSError, ImportError) as e:
        raise RunError(f"data: {' '.join(str(e).split())[:300]}") from None
    path = str(ck) if ck is not None else cfg.model.path
    if not Path(path).exists() and (path.count("/") != 1 or path.startswith((".", "/", "~")) or Path(path).parent.is_dir()):
        raise RunError(f"model.path {path} does not exist (a local folder or an org/name hub id)")
    device = torch.device(cfg.model.device if cfg.model.device != "auto" else f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
                          if torch.cuda.is_available() else "cpu")
    try:
        model, policy, tokenizer, ref, compute = load_policy(cfg, path, device, world)
    except Exception as e:  # noqa: BLE001 -- a missing, corrupt or foreign model folder is one line
        raise RunError(f"{'checkpoint' if ck else 'model.path'} {path}: {type(e).__name__}: "
                       f"{' '.join(str(e).split())[:300]}") from None
    try:
        stop = end_ids(tokenizer, model, cfg.data.chat_template, cfg.rollout.stop_tokens)
    except ValueError as e:
        raise RunError(str(e)) from None
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    limit = cfg.data.max_prompt_tokens or context - cfg.rollout.max_new_tokens
    if limit <= 0:
        raise RunError(f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) leaves no room for a prompt in the "
                       f"model's {context} positions")
    prompts, problems, dropped = build_prompts(tokenizer, problems, cfg.data, limit)
    eval_prompts, eval_problems, eval_dropped = build_prompts(tokenizer, eval_problems, cfg.data, limit)
    if not prompts or not eval_prompts:
        raise RunError(f"every {'training' if not prompts else 'eval'} prompt is over {limit} tokens (data.max_prompt_tokens)")
    if rank == 0 and dropped + eval_dropped:
        print(f"note: dropped {dropped} training and {eval_dropped} eval prompts over {limit} tokens", file=sys.stderr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  weight_decay=cfg.optim.weight_decay)
    replay = make_replay(cfg.replay, max_len=max(map(len, prompts)) + cfg.rollout.max_new_tokens,
                         pad_id=tokenizer.pad_token_id, seed=cfg.seed + rank)
    r = Run(cfg, out, rank, world, device, model, policy, tokenizer, ref, compute, optimizer, replay, prompts,
            [p.answer for p in problems], eval_prompts, [p.answer for p in eval_problems], stop,
            sharded=any(isinstance(m, FSDPModule) for m in model.modules()))
    try:
        r.progress["source_tokens"] = replay.start(problems, prompts, tokenizer, cfg)
    except (ValueError, OSError) as e:
        raise RunError(f"replay: {' '.join(str(e).split())[:300]}") from None
    if ck is not None:
        restore(r, ck, state)
        r.progress |= {k: v for k, v in state["run"].items() if k != "config"}
    if rank == 0:
        r.lock = claim_out_dir(out, overwrite)
        r.log = open_log(r, ck is not None)
    dist.barrier() if dist.is_initialized() else None
    return r


def open_log(r: Run, resumed: bool):
    """config.yaml, metrics.jsonl (cut back to the checkpoint's step on resume) and the wandb run, on rank 0."""
    path = r.out / "metrics.jsonl"
    if resumed:  # lines after the checkpoint will be written again; a line cut by a kill is dropped
        keep = []
        for ln in path.read_text().splitlines() if path.exists() else []:
            try:
                keep += [ln + "\n"] if json.loads(ln)["step"] <= r.progress["step"] else []
            except (ValueError, KeyError, TypeError):
                pass
        write_file(path, "".join(keep))
    write_file(r.out / "config.yaml", "")
    save_config(r.cfg, r.out / "config.yaml")
    if r.cfg.wandb.mode != "disabled":
        import wandb

        w = r.cfg.wandb
        r.wandb = wandb.init(project=w.project, group=w.group or None, name=w.name or f"{r.cfg.replay.strategy}-s{r.cfg.seed}",
                             tags=[r.cfg.replay.strategy], config=flat_dict(r.cfg), dir=str(r.out), mode=w.mode,
                             id=r.progress["wandb_id"], resume="allow" if r.progress["wandb_id"] else None)
        r.progress["wandb_id"] = r.wandb.id
    return open(path, "a")  # noqa: SIM115 -- closed by finish()


def run_eval(r: Run) -> dict:
    """Held-out eval: each rank samples its share of the prompts from its own fixed seed (so how often we evaluate
    never changes training randomness); every rank gets the summary over all of them."""
    e = r.cfg.eval
    sampling = replace(r.cfg.rollout, group_size=e.k, temperature=e.temperature, top_p=e.top_p, top_k=0,
                       max_new_tokens=e.max_new_tokens or r.cfg.rollout.max_new_tokens)
    with torch.random.fork_rng(devices=[r.device] if r.device.type == "cuda" else []), full_weights(r.model, r.compute):
        torch.manual_seed(r.cfg.seed + r.rank)
        records = evaluate(r.model, r.tokenizer, r.eval_prompts[r.rank :: r.world], r.eval_golds[r.rank :: r.world],
                           sampling, r.cfg.reward, r.stop)
    if dist.is_initialized():
        parts = [None] * r.world
        dist.all_gather_object(parts, records)
        records = [x for part in parts for x in part]
    return summarize(records)


# ---------------------------------------------------------------------------------------------- training loop


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> int:
    """Set up, run the loop, finish; returns the exit code (0, or 143 / 130 after SIGTERM / SIGINT)."""
    r = setup(cfg, resume, overwrite)
    try:
        return finish(r, loop(r))
    except BaseException as e:
        if r.rank == 0 and (r.out / ".overwritten").is_dir():  # failed before its first step: the old run comes back
            restore_overwritten(r.out)
        if isinstance(e, FloatingPointError):
            last = checkpoints(r.out)
            raise RunError(f"{e} at step {r.progress['step'] + 1} (optim.lr too high?); the last good checkpoint is "
                           + (f"{last[-1].name}: --resume={last[-1].name} with a lower lr" if last else "none")) from None
        raise
    finally:
        for f in (r.log, r.lock):
            f.close() if f is not None else None
        dist.destroy_process_group() if dist.is_initialized() else None


def loop(r: Run) -> int:
    """Generation steps until max_steps or a stop signal; returns the signal number (0 = ran to the end)."""
    cfg, p, G = r.cfg, r.progress, r.cfg.rollout.group_size
    n_prompts, signals, t_run = cfg.rollout.batch_size // G, StopSignal(), time.time() - p["wall"]
    if p["step"] == 0:
        p["eval_initial"] = p["eval_last"] = run_eval(r)
    bar = tqdm(range(p["step"], cfg.max_steps), initial=p["step"], total=cfg.max_steps, disable=r.rank != 0)
    for step in bar:
        t, at_start = {}, (rng_state(), p["data_pos"])
        with timed(t, "generate"):  # 1. Rollout: this rank's share of the step's prompts, G samples each
            idx = prompt_order(len(r.prompts), p["data_pos"], n_prompts, cfg.seed)[r.rank :: r.world]
            p["data_pos"] += n_prompts
            with full_weights(r.model, r.compute):
                fresh, texts = generate(r.model, r.tokenizer, [r.prompts[i] for i in idx], cfg.rollout, r.stop, idx, step)
        with timed(t, "reward"):  # 2. Reward: verify each completion (plus DAPO's overlong shaping when on)
            golds = [r.golds[i] for i in idx for _ in range(G)]
            rewards, correct, reward_metrics = score_batch(texts, golds, cfg.reward)
            fresh.reward = torch.tensor(rewards) + overlong_penalty(fresh.completion_len, cfg.rollout.max_new_tokens,
                                                                    cfg.reward)
            fresh.correct = torch.tensor(correct)
        if signals.agreed():  # stop before anything of this step is kept: a checkpoint now is the step's start
            set_rng_state(at_start[0])
            p["data_pos"] = at_start[1]
            break
        with timed(t, "advantage"):  # 3. Advantages within each group (RLEP first appends stored successes)
            fresh = r.replay.before_advantages(fresh, step)
            fresh.advantage, adv_metrics = grpo.group_advantages(fresh.reward, fresh.group, cfg.grpo.adv_scale,
                                                                 cfg.grpo.adv_eps)
        with timed(t, "replay_sample"):  # 4. Replay: stored rollouts join this update (`none` adds nothing)
            replayed = r.replay.sample(fresh, step)
            batch = fresh if replayed is None else Rollouts.cat([fresh, replayed], r.tokenizer.pad_token_id)
        for group in r.optimizer.param_groups:  # the schedule counts generation steps, whatever optim.minibatches is
            group["lr"] = lr_at(step, cfg)
        # 5. Update: optim.minibatches optimizer steps, each over micro-batches (grpo.update_policy).
        update, _, reasons, times = grpo.update_policy(cfg, r.model, r.policy, r.optimizer, batch, r.device, r.compute,
                                                       r.ref)
        t |= times
        with timed(t, "replay_push"):  # 6. Replay push: fresh rows, with rewards, advantages and log-probs
            r.replay.push(batch.select(~batch.replayed), step)
        # 7. Log one line; 8. eval every eval.every steps and at the end; 9. checkpoint every checkpoint.every steps.
        row = log_row(r, step, fresh, batch, update, reasons, {**adv_metrics, **reward_metrics, **r.replay.metrics()}, t)
        if (cfg.eval.every and (step + 1) % cfg.eval.every == 0) or step + 1 == cfg.max_steps:
            with timed(t, "eval"):
                p["eval_last"] = run_eval(r)
            row |= {f"eval/{k}": v for k, v in p["eval_last"].items()} | {"time/eval": t["eval"]}
        p["step"], p["wall"] = step + 1, time.time() - t_run
        write_row(r, row | {"wall_seconds": p["wall"]})
        if cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.max_steps):
            save_checkpoint(r)
        if r.rank == 0 and (r.out / ".overwritten").is_dir():  # the new run has a step: the old one can go
            shutil.rmtree(r.out / ".overwritten")
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", eval=f"{p['eval_last'].get('accuracy', math.nan):.3f}")
        if signals.agreed():
            break
    return signals.signum


def log_row(r: Run, step: int, fresh: Rollouts, batch: Rollouts, update: dict, reasons: list, local: dict,
            t: dict) -> dict:
    """One metrics line: fresh-row statistics over every rank, the update's metrics, this rank's own metrics
    (advantages, verifier, replay buffer) averaged over ranks, phase times."""
    p, n = r.progress, fresh.completion_len.double()
    s = all_ranks(torch.stack([n.sum(), torch.tensor(len(fresh)), fresh.reward.double().sum(), fresh.correct.sum(),
                               fresh.truncated.sum(), (fresh.entropy.double() * n).sum(), batch.replayed.sum(),
                               batch.completion_len[batch.replayed].sum(), batch.completion_len.sum()]).double())
    keys = sorted(local)
    local = dict(zip(keys, (all_ranks(torch.tensor([float(local[k]) for k in keys])) / r.world).tolist())) if keys else {}
    p["generated_tokens"] += int(s[0])
    p["trained_tokens"] += int(update["tokens"])
    for reason in filter(None, reasons):
        p["skipped"][reason] += 1
    return {"step": step + 1, "generated_tokens": p["generated_tokens"],
            "tokens/generated_total": p["generated_tokens"] + p["source_tokens"], "tokens/trained": p["trained_tokens"],
            "reward_mean": (s[2] / s[1]).item(), "correct_mean": (s[3] / s[1]).item(), "response_len": (s[0] / s[1]).item(),
            "truncated_frac": (s[4] / s[1]).item(), "entropy/fresh": (s[5] / s[0].clamp(min=1)).item(),
            "replay/rows": int(s[6]), "replay/token_share": (s[7] / s[8].clamp(min=1)).item(),
            **{k: v for k, v in update.items() if k != "tokens"}, **local,
            **{f"skipped/{k}": v for k, v in p["skipped"].items()}, "lr": r.optimizer.param_groups[0]["lr"],
            **{f"time/{k}": v for k, v in t.items()}, "time/step": sum(t.values())}


def write_row(r: Run, row: dict) -> None:
    if r.rank != 0:
        return
    try:
        r.log.write(json.dumps(row) + "\n")
        r.log.flush()
    except OSError as e:
        raise RunError(f"{r.out / 'metrics.jsonl'} could not be written ({e.strerror}); checkpoints are intact") from None
    r.wandb.log(row, step=row["step"]) if r.wandb else None


def finish(r: Run, signum: int) -> int:
    """After the loop: on SIGTERM a checkpoint, on SIGINT a note; otherwise final/ and summary.json."""
    p, last = r.progress, checkpoints(r.out)
    if signum == signal.SIGTERM and not (last and last[-1].name == f"step_{p['step']:06d}"):
        save_checkpoint(r)
    if signum:
        last = checkpoints(r.out)
        where = f"--resume continues from {last[-1].name}" if last else "no checkpoint yet: rerun with --overwrite"
        print(f"\nstopped by {signal.Signals(signum).name} after step {p['step']}; {where}", file=sys.stderr)
        return 128 + signum
    save_model(r.model, r.tokenizer, r.out / "final")
    if r.rank == 0:
        ev0, ev1 = p["eval_initial"], p["eval_last"]
        summary = {"strategy": r.cfg.replay.strategy, "seed": r.cfg.seed, "steps": r.cfg.max_steps,
                   "eval_accuracy_initial": ev0.get("accuracy"), "eval_accuracy_final": ev1.get("accuracy"),
                   "eval_response_len_final": ev1.get("response_len"), "eval_entropy_final": ev1.get("entropy"),
                   "generated_tokens": p["generated_tokens"], "tokens_generated_total": p["generated_tokens"] + p["source_tokens"],
                   "tokens_trained": p["trained_tokens"], "wall_seconds": p["wall"], "skipped_updates": p["skipped"]}
        write_file(r.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        if (r.out / ".overwritten").is_dir():  # a run of 0 steps: finished now
            shutil.rmtree(r.out / ".overwritten")
        if r.wandb:
            r.wandb.summary.update(summary)
            r.wandb.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
