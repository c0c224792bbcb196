"""GRPO with experience replay, in one flat loop.

Usage:
  python train.py --config configs/tiny.yaml --out_dir=runs/tiny                 # embedded model + task, CPU
  python train.py --config configs/tiny.yaml --replay.strategy=aper --seed=1      # flip one key
  python train.py --config configs/tiny.yaml --out_dir=runs/tiny --resume         # continue after a kill or a stop
  torchrun --nproc_per_node=8 train.py --config configs/papers/rlep_qwen25_math_7b.yaml --out_dir=runs/rlep

Flags: --config FILE; --resume (the newest checkpoint) or --resume=step_000040; --overwrite (start over in a run's
out_dir, the old run kept aside until the new one has finished a step); --debug (tracebacks). Everything else is a
dotted config override (config.py). Bad input is one line and exit 2, found before anything is created or deleted.

A step: plan (replay may pick prompts) → rollout (HF generate, behaviour log-probs kept; rounds until enough groups
have a reward spread under rollout.dynamic_sampling) → reward → advantages (RLEP and ExGRPO first add stored rows to
groups) → replay sample → update (grpo.update_policy) → replay push → log → eval → checkpoint.
Under torchrun each rank generates for its share of the prompts and keeps its own buffer; loss normalisers are
global totals, so every rank applies the whole batch's update. Rank 0 logs and writes the model; each rank writes
its own trainer state.
SIGTERM at any moment (preemption) abandons a rollout or an eval under way, checkpoints the last
completed step and exits 143; --resume redoes the abandoned work exactly (loop(), preempt.py).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import grpo
import lora
import vllm_engine
from checkpoint import (
    RunError,
    aside,
    check_out_dir,
    checkpoints,
    claim_out_dir,
    drop_aside,
    find_checkpoint,
    intact,
    oneline,
    put_back,
    restore,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_file,
)
from config import (
    Config,
    ConfigError,
    budget,
    check_rules,
    flat_dict,
    load_config,
    save_config,
    update_settings,
    validate,
)
from data.loaders import load_task, prompt_order
from eval import evaluate, summarize
from preempt import STOP, Interrupted, abandonable
from replay import make_replay
from rewards import overlong_penalty, score_batch
from rollout import (
    ChatTemplateError,
    Rollouts,
    Row,
    build_prompts,
    end_ids,
    full_weights,
    generate,
    load_policy,
    pack,
    save_model,
    template_warnings,
)
from util import MAX, all_ranks, timed


def main(argv: list[str]) -> int:
    names = ("--resume", "--overwrite", "--debug")
    flags = {a.partition("=")[0]: a.partition("=")[2] for a in argv if a.partition("=")[0] in names}
    try:
        cfg = load_config(None, [a for a in argv if a.partition("=")[0] not in flags])
        validate(cfg)
        if "--resume" in flags and "--overwrite" in flags:
            raise ConfigError("--resume and --overwrite exclude each other")
        return train(cfg, resume=flags.get("--resume"), overwrite="--overwrite" in flags)
    except (ConfigError, RunError) as e:  # bad input; any other exception is a bug and keeps its traceback
        if "--debug" in flags:
            e.__suppress_context__ = False  # the exception it replaced is shown too
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


# -------------------------------------------------------------------------------------------------------- set-up


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
    ref: torch.nn.Module | None  # the frozen reference of the KL term (beta > 0)
    compute: object  # bf16 autocast context, or a null context
    optimizer: torch.optim.Optimizer
    replay: object
    prompts: list  # token ids of each training prompt, its gold answer; the same for the held-out ones
    golds: list
    eval_prompts: list
    eval_golds: list
    stop: list  # token ids that end a completion
    sharded: bool
    progress: dict = field(default_factory=lambda: {  # saved in checkpoints: with the states, all a resume needs
        "step": 0, "data_pos": 0, "generated_tokens": 0, "source_tokens": 0, "trained_tokens": 0, "wall": 0.0,
        "skipped": {"nonfinite": 0, "zero_adv": 0, "gated": 0}, "wandb_id": None,
        "eval_initial": {}, "eval_last": {}, "pending_row": None})  # (a step's line until written)
    log: object = None  # rank 0's: metrics.jsonl open for appending, the out_dir lock, the wandb run
    lock: object = None
    wandb: object = None
    engine: object = None  # rollout.engine=vllm: this rank's vllm_engine.Engine
    optimizer_steps: int = 0  # taken in this process; the engine holds those after `synced_at`
    synced_at: int = -1


def backend_map(device_type: str) -> str:
    """The process group's backends. gloo serves host tensors: our own reductions (all_ranks,
    save_model's failure flag, StopSignal, the replay buffers', restore's step check) and object
    collectives all run on CPU tensors, which NCCL alone does not serve; an accelerator adds its own
    backend for the model's collectives."""
    if device_type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device_type}:{dist.Backend.default_device_backend_map[device_type]}"


def setup(cfg: Config, resume: str | None, overwrite: bool) -> Run:
    """Check the folder, load data and model, restore a checkpoint (train() then claims out_dir)."""
    if "LOCAL_RANK" in os.environ and not dist.is_initialized():  # torchrun, even of one process
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = backend_map("cuda" if gpu else "cpu")
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = Path(os.path.abspath(cfg.out_dir))  # absolute: --overwrite may rename the current folder
    check_out_dir(out, resume, overwrite)
    if (n_prompts := cfg.rollout.batch_size // cfg.rollout.group_size) % world:
        raise RunError(f"prompts per step ({n_prompts}) must be divisible by the number of processes ({world})")
    ck, state = find_checkpoint(out, resume, rank) if resume is not None else (None, {})
    torch.set_num_threads(cfg.threads) if cfg.threads else None
    random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed + rank)  # ranks sample differently
    try:  # data before the model: a bad file fails fast
        problems, eval_problems = load_task(cfg.data, cfg.eval.n)
    except (ValueError, TypeError, OSError, ImportError) as e:
        raise RunError(f"data: {oneline(e)}") from None
    path = str(ck) if ck else cfg.model.path
    hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not Path(path).parent.is_dir()
    if not Path(path).exists() and not hub_id:
        raise RunError(f"model.path {path} does not exist (a local folder or an org/name hub id)")
    local_gpu = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    device = torch.device(cfg.model.device if cfg.model.device != "auto" else local_gpu)
    try:
        model, policy, tokenizer, ref, compute = load_policy(cfg, path, device, world)
    except Exception as e:  # noqa: BLE001 -- a missing, corrupt or foreign model folder is one line
        what = "checkpoint" if ck else "model.path"
        raise RunError(f"{what} {path}: {type(e).__name__}: {oneline(e)}") from None
    try:
        stop = end_ids(tokenizer, model, cfg.data.chat_template, cfg.rollout.stop_tokens)
    except ValueError as e:
        raise RunError(str(e)) from None
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    limit = cfg.data.max_prompt_tokens or context - cfg.rollout.max_new_tokens
    (prompts, problems, dropped), (eval_prompts, eval_problems, eval_dropped) = chat_prompts(
        cfg, tokenizer, path, rank, (problems, eval_problems), limit)
    if not prompts or not eval_prompts:
        what = "eval" if prompts else "training"
        raise RunError(f"every {what} prompt is over {limit} tokens (data.max_prompt_tokens, rollout.max_new_tokens "
                       f"and the model's {context} positions set the limit)")
    if rank == 0 and dropped + eval_dropped:
        print(f"note: dropped {dropped} training and {eval_dropped} eval prompts over {limit} tokens", file=sys.stderr)
    trained = [p for p in model.parameters() if p.requires_grad]  # under LoRA, the adapters alone
    betas = (cfg.optim.beta1, cfg.optim.beta2)
    optimizer = torch.optim.AdamW(trained, lr=cfg.optim.lr, betas=betas,
                                  weight_decay=cfg.optim.weight_decay)
    max_len = max(map(len, prompts)) + cfg.rollout.max_new_tokens
    check_rules(cfg, budget(cfg, len(eval_prompts), max_len))  # the real prompts, before any buffer
    replay = make_replay(cfg.replay, max_len, tokenizer.pad_token_id, cfg.seed + rank)
    r = Run(cfg, out, rank, world, device, model, policy, tokenizer, ref, compute, optimizer, replay, prompts,
            [p.answer for p in problems], eval_prompts, [p.answer for p in eval_problems], stop,
            sharded=any(isinstance(p, DTensor) for p in model.parameters()))
    r.engine = start_engine(r)
    try:
        r.progress["source_tokens"] = replay.start(problems, prompts, tokenizer, cfg, lambda rows: row_entropy(r, rows))
    except (ValueError, OSError) as e:
        raise RunError(f"replay: {oneline(e)}") from None
    if ck:
        restore(ck, state, cfg, model, optimizer, replay, r.progress)
    return r


def start_engine(r: Run):
    """rollout.engine=vllm: this rank's engine, loaded from model.path (a checkpoint may hold LoRA
    adapters alone; the policy's weights replace these before sampling), long enough for the
    longest prompt and completion of training and eval."""
    if r.cfg.rollout.engine != "vllm":
        return None
    new_tokens = max(r.cfg.rollout.max_new_tokens, r.cfg.eval.max_new_tokens)
    longest = max(map(len, r.prompts + r.eval_prompts)) + new_tokens
    dtype = torch.bfloat16 if r.cfg.model.compute_dtype == "bfloat16" else torch.float32
    try:
        return vllm_engine.Engine(r.cfg.model.path, r.cfg.rollout, dtype, r.device, longest,
                                  r.cfg.model.trust_remote_code)
    except (ValueError, RuntimeError, OSError) as e:
        raise RunError(f"rollout.engine=vllm: {type(e).__name__}: {oneline(e)}") from None


def sync_engine(r: Run, t: dict) -> None:
    """Before a generation phase: the engine gets the policy's weights, one parameter at a time
    (FSDP: each gathered whole on its own; LoRA: each with its adapter merged in), unless no
    optimizer step was taken since the last."""
    if r.engine is None:
        return
    with timed(t, "weight_sync"):
        if r.synced_at != r.optimizer_steps:
            dtype = torch.bfloat16 if r.cfg.model.compute_dtype == "bfloat16" else torch.float32
            if r.cfg.model.lora.rank > 0:
                weights = vllm_engine.cast(lora.merged_weights(r.model), dtype)
            else:
                weights = vllm_engine.full_parameters(r.model, dtype)
            r.engine.sync(weights)
            r.synced_at = r.optimizer_steps


def chat_prompts(cfg: Config, tokenizer, path: str, rank: int, sets: tuple, limit: int) -> list:
    """build_prompts of each problem set: a chat template that fails is one line naming the model
    and the key to change, one that leaves out the system turn (or the problem) a warning."""
    try:
        built = [build_prompts(tokenizer, problems, cfg.data, limit) for problems in sets]
        system = cfg.data.system_prompt or next((p.system for p in sets[0] if p.system), "")
        said = template_warnings(tokenizer, system) if cfg.data.chat_template else []
    except ChatTemplateError as e:
        advice = template_advice(e, cfg)
        raise RunError(f"model.path {path}: its chat template {e.said}; {advice}") from e
    for what in said if rank == 0 else []:
        print(f"warning: model.path {path}: its chat template {what}: the model never sees it",
              file=sys.stderr)
    return built


def template_advice(e: ChatTemplateError, cfg: Config) -> str:
    """Which setting avoids a chat template's failure."""
    if e.system and cfg.data.system_prompt:
        return "set data.system_prompt= (none) or data.chat_template=false (plain prompts)"
    if e.system:
        return "the data's rows carry a system turn: set data.chat_template=false (plain prompts)"
    return "set data.chat_template=false (plain prompts) or fix the template in the model folder"


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
    write_file(r.out / "config.yaml", "")  # fails here, before a step, on a folder that takes no files
    save_config(r.cfg, r.out / "config.yaml")
    if r.cfg.wandb.mode != "disabled":
        import wandb

        w, strategy, run_id = r.cfg.wandb, r.cfg.replay.strategy, r.progress["wandb_id"]
        r.wandb = wandb.init(project=w.project, group=w.group or None, name=w.name or f"{strategy}-s{r.cfg.seed}",
                             tags=[strategy], config=flat_dict(r.cfg), dir=str(r.out), mode=w.mode, id=run_id,
                             resume="allow" if run_id else None)
        r.progress["wandb_id"] = r.wandb.id
    return open(path, "a")


def row_entropy(r: Run, rows: Rollouts) -> torch.Tensor:
    """(B,) the current policy's mean token entropy of each row (no gradient); every rank must call it together."""
    n, blank = len(rows), pack([Row([0, 0], 1, [0.0], False, 0.0)], 0, torch.zeros(1), torch.zeros(1), 0)
    rows = rows if n else blank
    settings = update_settings(r.cfg)
    _, ent = grpo.no_grad_logprobs(r.model, rows, settings, r.compute, r.device, with_entropy=True)
    return (ent.sum(1) / rows.completion_len.clamp(min=1))[:n]  # (no rows: a stand-in ran, its value is dropped)


def run_eval(r: Run, t: dict | None = None) -> dict:
    """Held-out eval: each rank samples its share of the prompts from its own fixed seed (how often we evaluate never
    changes training randomness); every rank gets the summary over all of them. A stop abandons it
    (Interrupted)."""
    e = r.cfg.eval
    sampling = replace(r.cfg.rollout, group_size=e.k, temperature=e.temperature, top_p=e.top_p, top_k=0,
                       max_new_tokens=e.max_new_tokens or r.cfg.rollout.max_new_tokens)
    sync_engine(r, {} if t is None else t)
    desc = f"eval {r.progress['step']}" if r.rank == 0 else None  # a bar: a real eval takes minutes
    with torch.random.fork_rng(devices=[r.device] if r.device.type == "cuda" else []), full_weights(r.model, r.compute):
        torch.manual_seed(r.cfg.seed + r.rank)
        prompts, golds = r.eval_prompts[r.rank :: r.world], r.eval_golds[r.rank :: r.world]
        with abandonable():
            records = evaluate(r.model, r.tokenizer, prompts, golds, sampling, r.cfg.reward, r.stop,
                               desc, leave=False, engine=r.engine, key=("eval", r.cfg.seed, r.rank))
    if dist.is_initialized():
        parts = [None] * r.world
        dist.all_gather_object(parts, records)
        records = [x for part in parts for x in part]
    return summarize(records)


# ------------------------------------------------------------------------------------------------------ the loop


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> int:
    """Set up, run the loop, finish; returns the exit code (0, or 143 / 130 after SIGTERM / SIGINT)."""
    STOP.install()  # a signal is a request from here on (during set-up too)
    r = setup(cfg, resume, overwrite)
    try:
        if r.rank == 0:  # only now, everything loaded and checked, is out_dir claimed
            r.lock = claim_out_dir(r.out, overwrite)
            r.log = open_log(r, resume is not None)
        if dist.is_initialized():
            dist.barrier()
        return finish(r, loop(r))
    except BaseException as e:
        if r.lock is not None and aside(r.out).is_dir():  # failed before its first step
            put_back(r.out)
        if isinstance(e, OSError):  # a failed write (a full disk): one line, what is intact
            raise RunError(f"{oneline(e)}; {intact(r.out)}") from None
        if isinstance(e, FloatingPointError):
            last = checkpoints(r.out)
            good = f"{last[-1].name}: --resume={last[-1].name} with a lower lr" if last else "none"
            step = r.progress["step"] + 1
            raise RunError(f"{e} at step {step} (optim.lr too high?); the last good checkpoint is {good}") from None
        raise
    finally:
        [f.close() for f in (r.log, r.lock) if f is not None]
        if r.engine is not None:  # first: vLLM tears down its groups (and a world it made)
            r.engine.close()
        dist.destroy_process_group() if dist.is_initialized() else None


def get_lr(step: int, cfg: Config) -> float:
    """Learning rate of generation step `step` (0-based): linear warm-up, then constant or cosine
    decay."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, cfg.max_steps - o.warmup_steps))
    cosine = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if o.schedule == "cosine":
        return o.lr * cosine
    return o.lr


def loop(r: Run) -> int:
    """Generation steps until max_steps or a stop; returns the signal number (0 = ran to the end).

    A stop (SIGTERM, SIGINT: preempt.py) abandons the rollout or the eval under way, and the loop
    ends at the last completed step. An abandoned rollout is redone after --resume from this step's
    start (its RNG streams and data position are put back); an abandoned eval is run by --resume
    before the next step (the step's metrics line waits for it in the checkpoint). An update under
    way finishes: its time is bounded (one batch, whatever the eval's or the generation's length),
    and abandoning it would need a copy of the weights and optimizer state from before it (with
    optim.minibatches > 1 it has already stepped the optimizer)."""
    cfg, p = r.cfg, r.progress
    try:
        if p["step"] == 0:
            p["eval_initial"] = p["eval_last"] = run_eval(r)
        t_run = time.time() - p["wall"]
        if p["pending_row"]:  # a stop cut the last step's eval short
            end_step(r, t_run)
    except Interrupted:
        return STOP.signum
    bar = tqdm(range(p["step"], cfg.max_steps), initial=p["step"], total=cfg.max_steps, disable=r.rank > 0)
    for step in bar:
        t = {}
        if (done := rollout_or_rewind(r, step, t)) is None:  # 1-2. rollout and reward
            break
        fresh, rounds, generated = done
        if r.engine is not None:  # GPU: the KV cache is freed while the trainer needs the memory
            r.engine.sleep()
        p["generated_tokens"] += generated
        with timed(t, "advantage"):  # 3. Advantages within each group (RLEP, ExGRPO first add stored rows to groups)
            fresh = r.replay.before_advantages(fresh, step)
            fresh.advantage, adv_metrics = grpo.group_advantages(fresh.reward, fresh.group, cfg.grpo.adv_scale,
                                                                 cfg.grpo.adv_eps)
        with timed(t, "replay_sample"):  # 4. Replay: the update batch, fresh rows and stored ones
            batch = r.replay.sample(fresh, step)
        for group in r.optimizer.param_groups:  # the schedule counts generation steps, whatever optim.minibatches is
            group["lr"] = get_lr(step, cfg)
        # 5. Update: optim.minibatches optimizer steps, each of micro-batches. A stop waits for it.
        update, entropy, skipped, times = grpo.update_policy(
            update_settings(cfg), r.model, r.policy, r.optimizer, batch, r.device, r.compute, r.ref)
        t |= times
        r.optimizer_steps += sum(reason is None for reason in skipped)
        with timed(t, "replay_push"):  # 6. Replay push: the batch after the update, with each row's entropy now
            r.replay.push(batch, step, entropy)
        # 7. Log one line (8. after the eval, every eval.every steps and at the end);
        # 9. checkpoint every checkpoint.every steps.
        p["step"] = step + 1
        local = {**adv_metrics, **rounds, **r.replay.metrics()}
        p["pending_row"] = log_row(r, step, fresh, batch, update, skipped, local, t)
        try:
            row = end_step(r, t_run)
        except Interrupted:  # the step is done: the checkpoint keeps its line for --resume
            break
        if cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.max_steps):
            save_checkpoint(r.out, cfg, r.model, r.tokenizer, r.optimizer, r.replay, p)
        if r.rank == 0:
            drop_aside(r.out)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", eval=f"{p['eval_last'].get('accuracy', math.nan):.3f}")
        if STOP.agreed():
            break
    return STOP.agreed()  # (the same answer on every rank, even for a signal during the last step)


def end_step(r: Run, t_run: float) -> dict:
    """The finished step's eval when due, then its metrics line (kept in progress until written)."""
    cfg, p, row = r.cfg, r.progress, r.progress["pending_row"]
    if (cfg.eval.every and p["step"] % cfg.eval.every == 0) or p["step"] == cfg.max_steps:
        t0 = time.perf_counter()
        p["eval_last"] = run_eval(r)
        evals = {f"eval/{k}": v for k, v in p["eval_last"].items()}
        row = row | evals | {"time/eval": time.perf_counter() - t0}
    p["wall"] = time.time() - t_run
    write_row(r, row | {"wall_seconds": p["wall"]})
    p["pending_row"] = None
    return row


def rollout_or_rewind(r: Run, step: int, t: dict) -> tuple[Rollouts, dict, int] | None:
    """rollout(), or None when a stop abandoned it (or came during the reward): the RNG streams, the
    data position and the replay sampler are put back, so a checkpoint now is this step's start."""
    start = (rng_state(), r.progress["data_pos"], r.replay.gen.get_state())
    try:
        done = rollout(r, step, t)
        if STOP.agreed():
            raise Interrupted
        return done
    except Interrupted:
        set_rng_state(start[0])
        r.progress["data_pos"] = start[1]
        r.replay.gen.set_state(start[2])  # (exgrpo's plan draws from it)
        return None


def rollout(r: Run, step: int, t: dict) -> tuple[Rollouts, dict, int]:
    """This step's fresh rows, rewarded, with their metrics and the tokens generated (every rank's). Under
    rollout.dynamic_sampling = N > 0 (DAPO's dynamic sampling), up to N rounds of new prompts run until every rank holds
    its share of batch_size / G groups with a reward spread; a capped step fills up with flat groups. Every generated
    token counts; the metrics say how many rounds ran, how many groups were dropped and whether the cap was hit."""
    cfg, p, G, R = r.cfg, r.progress, r.cfg.rollout.group_size, max(1, r.cfg.rollout.dynamic_sampling)
    n, kept, spare, generated = cfg.rollout.batch_size // G, [], [], 0
    for rnd in range(R):
        sync_engine(r, t)
        with timed(t, "generate"):
            idx = prompt_order(len(r.prompts), p["data_pos"], n, cfg.seed)[r.rank :: r.world]
            idx, counts = r.replay.plan(idx, G, step) if rnd == 0 else (idx, [G] * len(idx))
            p["data_pos"] += n
            with full_weights(r.model, r.compute), abandonable():  # a stop: Interrupted, every rank
                fresh, texts = sample(r, idx, step, counts, (step * R + rnd) * n, rnd)
            generated += int(all_ranks(float(fresh.completion_len.sum())))
        with timed(t, "reward"):
            rewards, correct, metrics = score_batch(texts, [r.golds[i] for i in fresh.prompt_idx.tolist()], cfg.reward)
            penalty = overlong_penalty(fresh.completion_len, cfg.rollout.max_new_tokens, cfg.reward)
            fresh.reward = torch.tensor(rewards) + penalty
            fresh.correct = torch.tensor(correct)
        if not cfg.rollout.dynamic_sampling:
            return fresh, metrics, generated
        flat = grpo.flat_groups(fresh.reward, fresh.group)
        kept, spare = kept + [fresh.select(~flat)], spare + [fresh.select(flat)]
        if all_ranks(float(sum(len(set(k.group.tolist())) for k in kept) >= n // r.world), dist.ReduceOp.MIN):
            break
    fresh = Rollouts.cat(kept + spare, r.tokenizer.pad_token_id)  # informative groups first
    use = torch.tensor(list(dict.fromkeys(fresh.group.tolist()))[: n // r.world])
    capped = bool(grpo.flat_groups(fresh.reward, fresh.group)[torch.isin(fresh.group, use)].any())
    metrics |= {"dynamic/rounds": rnd + 1.0, "dynamic/capped": float(capped),
                "dynamic/groups_dropped": float(fresh.group.unique().numel() - len(use))}
    return fresh.select(torch.isin(fresh.group, use)), metrics, generated


def sample(r: Run, idx: list, step: int, counts: list, group0: int, rnd: int) -> tuple:
    """(Rollouts, texts) of training prompts `idx`: HF generate, or the engine (seeded per request
    from the run's seed, step, round and rank; an entropy it cannot give is measured here)."""
    prompts = [r.prompts[i] for i in idx]
    if r.engine is None:
        return generate(r.model, r.tokenizer, prompts, r.cfg.rollout, r.stop, idx, step, counts,
                        group0=group0)
    key = ("train", r.cfg.seed, step, rnd, r.rank)
    ro, texts = r.engine.generate(r.tokenizer, prompts, r.cfg.rollout, r.stop, idx, step, counts,
                                  group0, key)
    vllm_engine.fill_entropy(ro, r.model, r.cfg.rollout.temperature, r.device)
    return ro, texts


def log_row(r: Run, step: int, fresh: Rollouts, batch: Rollouts, update: dict, skipped: list, local: dict,
            t: dict) -> dict:
    """One metrics line: fresh-row statistics over every rank, the update's metrics, this rank's own metrics
    (advantages, verifier, replay buffer, dynamic sampling) averaged over ranks, and phase times."""
    p, n = r.progress, fresh.completion_len.double()
    s = all_ranks(torch.stack([n.sum(), torch.tensor(len(fresh)), fresh.reward.double().sum(), fresh.correct.sum(),
                               fresh.truncated.sum(), (fresh.entropy.double() * n).sum(), batch.replayed.sum(),
                               batch.completion_len[batch.replayed].sum(), batch.completion_len.sum()]).double())
    keys = sorted(local)
    local = dict(zip(keys, (all_ranks(torch.tensor([float(local[k]) for k in keys])) / r.world).tolist()))
    p["trained_tokens"] += int(update["tokens"])
    for reason in filter(None, skipped):
        p["skipped"][reason] = p["skipped"].get(reason, 0) + 1  # older checkpoints lack "gated"
    return {"step": step + 1, "generated_tokens": p["generated_tokens"], "tokens/trained": p["trained_tokens"],
            "tokens/generated_total": p["generated_tokens"] + p["source_tokens"], "reward_mean": (s[2] / s[1]).item(),
            "correct_mean": (s[3] / s[1]).item(), "response_len": (s[0] / s[1]).item(),
            "truncated_frac": (s[4] / s[1]).item(), "entropy/fresh": (s[5] / s[0].clamp(min=1)).item(),
            "replay/rows": int(s[6]), "replay/token_share": (s[7] / s[8].clamp(min=1)).item(),
            **{k: v for k, v in update.items() if k != "tokens"}, **local, "lr": r.optimizer.param_groups[0]["lr"],
            **{f"skipped/{k}": v for k, v in p["skipped"].items()}, **{f"time/{k}": v for k, v in t.items()},
            "time/step": sum(t.values())}


def write_row(r: Run, row: dict) -> None:
    if r.rank == 0:
        r.log.write(json.dumps(row) + "\n")
        r.log.flush()
        r.wandb.log(row, step=row["step"]) if r.wandb else None


def finish(r: Run, signum: int) -> int:
    """After the loop: on SIGTERM a checkpoint, on SIGINT a note where to resume; otherwise final/ and summary.json."""
    p, last = r.progress, checkpoints(r.out)
    if signum == signal.SIGTERM and not (last and last[-1].name == f"step_{p['step']:06d}"):
        save_checkpoint(r.out, r.cfg, r.model, r.tokenizer, r.optimizer, r.replay, p)
    if signum:
        where = f"--resume continues from {checkpoints(r.out)[-1].name}" if checkpoints(r.out) else "no checkpoint yet"
        if p["pending_row"] and signum == signal.SIGTERM:
            where += f" (with the eval of step {p['step']}, cut short)"
        print(f"\nstopped by {signal.Signals(signum).name} after step {p['step']}; {where}", file=sys.stderr)
        return 128 + signum
    save_model(r.model, r.tokenizer, r.out / "final", dtype=getattr(torch, r.cfg.model.compute_dtype))
    if r.rank == 0:
        ev0, ev1 = p["eval_initial"], p["eval_last"]
        summary = {"strategy": r.cfg.replay.strategy, "seed": r.cfg.seed, "steps": r.cfg.max_steps,
                   "eval_accuracy_initial": ev0.get("accuracy"), "eval_accuracy_final": ev1.get("accuracy"),
                   "eval_response_len_final": ev1.get("response_len"), "eval_entropy_final": ev1.get("entropy"),
                   "generated_tokens": p["generated_tokens"], "tokens_trained": p["trained_tokens"],
                   "tokens_generated_total": p["generated_tokens"] + p["source_tokens"], "wall_seconds": p["wall"],
                   "skipped_updates": p["skipped"]}
        write_file(r.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        drop_aside(r.out)  # a run of 0 steps
        r.wandb.summary.update(summary) if r.wandb else None
        r.wandb.finish() if r.wandb else None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
