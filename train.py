"""GRPO with experience replay, in one flat loop.

  python train.py --config configs/tiny.yaml --out_dir=runs/tiny            # tiny model, CPU
  python train.py --config configs/tiny.yaml --out_dir=runs/tiny --resume    # after a kill
  torchrun --nproc_per_node=8 train.py --config configs/papers/rlep_qwen25_math_7b.yaml

Flags: --resume (the newest checkpoint, or --resume=step_000040); --overwrite (the old run is kept
aside until the new one has finished a step); --debug. Everything else is a dotted config override
(config.py). Bad input is one line and exit 2, found before anything is written. Under torchrun
each rank generates for its share of the prompts and keeps its own buffer; loss normalisers are
global totals, so every rank applies the whole batch's update.
"""

from __future__ import annotations

import datetime
import functools
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
from tqdm import tqdm

import checkpoint
import grpo
import lora
import vllm_engine
from checkpoint import RunError, checkpoints
from config import Config, ConfigError, budget, check_rules, flat_dict, load_config, save_config
from config import update_settings, validate
from data.loaders import load_task, prompt_order
from eval import evaluate, summarize
from preempt import STOP, Interrupted, abandonable
from replay import make_replay
from rewards import overlong_penalty, score_batch
from rollout import ChatTemplateError, Rollouts, Row, build_prompts, end_ids, full_weights, generate
from rollout import load_policy, pack, save_model, template_warnings
from util import all_ranks, oneline, rank_and_world, timed


def main(argv: list[str]) -> int:
    flags = {}
    for arg in argv:
        name, _, value = arg.partition("=")
        if name in ("--resume", "--overwrite", "--debug"):
            flags[name] = value
    try:
        cfg = load_config(None, [a for a in argv if a.partition("=")[0] not in flags])
        validate(cfg)
        if "--resume" in flags and "--overwrite" in flags:
            raise ConfigError("--resume and --overwrite exclude each other")
        return train(cfg, resume=flags.get("--resume"), overwrite="--overwrite" in flags)
    except (ConfigError, RunError) as e:  # bad input; any other exception is a bug: a traceback
        if "--debug" in flags:
            e.__suppress_context__ = False  # the exception it replaced is shown too
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


# ------------------------------------------------------------------------------------- set-up


@dataclass
class Run:
    """What set-up builds and the loop uses."""

    cfg: Config
    out: Path
    rank: int
    world: int
    device: torch.device
    model: torch.nn.Module  # the HF module: generation, no-grad passes, saving (FSDP: sharded)
    policy: torch.nn.Module  # what the training forward goes through: model, compiled, or DDP
    tokenizer: object
    ref: torch.nn.Module | None  # the frozen reference of the KL term (beta > 0)
    compute: object  # bf16 autocast context, or a null context
    optimizer: torch.optim.Optimizer
    replay: object
    prompts: list  # token ids of each training prompt, its gold answer; the same for eval
    golds: list
    eval_prompts: list
    eval_golds: list
    stop: list  # token ids that end a completion
    settings: grpo.UpdateSettings  # what grpo's update and no-grad passes read of cfg
    progress: dict = field(default_factory=lambda: {  # saved in checkpoints with the states
        "step": 0, "data_pos": 0, "wall": 0.0, "wandb_id": None,
        "generated_tokens": 0, "source_tokens": 0, "trained_tokens": 0,
        "skipped": {"nonfinite": 0, "zero_adv": 0, "gated": 0},
        "eval_initial": {}, "eval_last": {},
        "pending_row": None})  # a step's metrics line until it is written
    log: object = None  # rank 0's: metrics.jsonl open for appending, the out_dir lock, wandb
    lock: object = None
    wandb: object = None
    engine: object = None  # rollout.engine=vllm: this rank's vllm_engine.Engine
    optimizer_steps: int = 0  # taken in this process; the engine holds those up to `synced_at`
    synced_at: int = -1


def backend_map(device_type: str) -> str:
    """gloo for our collectives on host tensors (NCCL serves none); NCCL for the model's."""
    if device_type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device_type}:{dist.Backend.default_device_backend_map[device_type]}"


def setup(cfg: Config, resume: str | None, overwrite: bool) -> Run:
    """Check the folder, load data and model, restore a checkpoint (train() then claims out_dir)."""
    if "LOCAL_RANK" in os.environ and not dist.is_initialized():  # torchrun, even of one process
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = backend_map("cuda" if torch.cuda.is_available() else "cpu")
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
    rank, world = rank_and_world()
    out = Path(os.path.abspath(cfg.out_dir))  # absolute: --overwrite may rename the current folder
    checkpoint.check_out_dir(out, resume, overwrite)
    n_prompts = cfg.rollout.batch_size // cfg.rollout.group_size
    if n_prompts % world:
        raise RunError(f"prompts per step ({n_prompts}) must be divisible by the number of "
                       f"processes ({world})")
    ck, state = None, {}
    if resume is not None:
        ck, state = checkpoint.find_checkpoint(out, resume, rank)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed + rank)  # ranks sample differently
    try:  # data before the model: a bad file fails fast
        problems, eval_problems = load_task(cfg.data, cfg.eval.n)
    except (ValueError, TypeError, OSError, ImportError) as e:
        raise RunError(f"data: {oneline(e)}") from None
    path = str(ck) if ck else cfg.model.path
    device, (model, policy, tokenizer, ref, compute) = load_model(cfg, path, world, ck)
    try:
        stop = end_ids(tokenizer, model, cfg.data.chat_template, cfg.rollout.stop_tokens)
    except ValueError as e:
        raise RunError(str(e)) from None
    sets = chat_prompts(cfg, tokenizer, model, path, rank, (problems, eval_problems))
    (prompts, problems, _), (eval_prompts, eval_problems, _) = sets
    trained = [p for p in model.parameters() if p.requires_grad]  # under LoRA, the adapters alone
    betas = (cfg.optim.beta1, cfg.optim.beta2)
    optimizer = torch.optim.AdamW(trained, lr=cfg.optim.lr, betas=betas,
                                  weight_decay=cfg.optim.weight_decay)
    max_len = max(map(len, prompts)) + cfg.rollout.max_new_tokens
    check_rules(cfg, budget(cfg, len(eval_prompts), max_len))  # the real prompts, before a buffer
    replay = make_replay(cfg.replay, max_len, tokenizer.pad_token_id, cfg.seed + rank)
    golds = [p.answer for p in problems]
    eval_golds = [p.answer for p in eval_problems]
    r = Run(cfg, out, rank, world, device, model, policy, tokenizer, ref, compute, optimizer,
            replay, prompts, golds, eval_prompts, eval_golds, stop, update_settings(cfg))
    r.engine = start_engine(r)
    entropy = functools.partial(row_entropy, r)  # the replay strategies that score stored rows
    try:
        r.progress["source_tokens"] = replay.start(problems, prompts, tokenizer, cfg, entropy)
    except (ValueError, OSError) as e:
        raise RunError(f"replay: {oneline(e)}") from None
    if ck:
        checkpoint.restore(ck, state, cfg, model, optimizer, replay, r.progress)
    return r


def load_model(cfg: Config, path: str, world: int, ck: Path | None) -> tuple:
    """(device, load_policy's modules); a missing, corrupt or foreign model folder is one line."""
    local = path.startswith((".", "/", "~")) or Path(path).parent.is_dir()
    hub_id = path.count("/") == 1 and not local
    if not Path(path).exists() and not hub_id:
        raise RunError(f"model.path {path} does not exist (a local folder or an org/name hub id)")
    local_gpu = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    device = torch.device(local_gpu if cfg.model.device == "auto" else cfg.model.device)
    try:
        return device, load_policy(cfg, path, device, world)
    except Exception as e:
        what = "checkpoint" if ck else "model.path"
        raise RunError(f"{what} {path}: {type(e).__name__}: {oneline(e)}") from None


def chat_prompts(cfg: Config, tokenizer, model, path: str, rank: int, sets: tuple) -> list:
    """build_prompts of each problem set, those over the context dropped; a chat template that fails
    is one line naming the key to change, one that leaves out the system turn a warning."""
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    limit = cfg.data.max_prompt_tokens or context - cfg.rollout.max_new_tokens
    try:
        built = [build_prompts(tokenizer, problems, cfg.data, limit) for problems in sets]
        system = cfg.data.system_prompt or next((p.system for p in sets[0] if p.system), "")
        said = template_warnings(tokenizer, system) if cfg.data.chat_template else []
    except ChatTemplateError as e:
        advice = template_advice(e, cfg)
        raise RunError(f"model.path {path}: its chat template {e.said}; {advice}") from e
    if rank == 0:
        for what in said:
            print(f"warning: model.path {path}: its chat template {what}: the model never sees it",
                  file=sys.stderr)
    (prompts, _, dropped), (eval_prompts, _, eval_dropped) = built
    if not prompts or not eval_prompts:
        what = "eval" if prompts else "training"
        raise RunError(f"every {what} prompt is over {limit} tokens (data.max_prompt_tokens, "
                       f"rollout.max_new_tokens and the model's {context} positions set the limit)")
    if rank == 0 and dropped + eval_dropped:
        print(f"note: dropped {dropped} training and {eval_dropped} eval prompts over {limit} "
              "tokens", file=sys.stderr)
    return built


def template_advice(e: ChatTemplateError, cfg: Config) -> str:
    """Which setting avoids a chat template's failure."""
    if e.system and cfg.data.system_prompt:
        return "set data.system_prompt= (none) or data.chat_template=false (plain prompts)"
    if e.system:
        return "the data's rows carry a system turn: set data.chat_template=false (plain prompts)"
    return "set data.chat_template=false (plain prompts) or fix the template in the model folder"


def start_engine(r: Run):
    """rollout.engine=vllm: this rank's engine (its weights replaced by the policy's before use)."""
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
    """The engine gets the policy's weights, one parameter at a time, if they changed since."""
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


def open_log(r: Run, resumed: bool):
    """config.yaml, metrics.jsonl (cut back to the checkpoint's step on resume), the wandb run."""
    path = r.out / "metrics.jsonl"
    if resumed:  # lines after the checkpoint will be written again; a line cut by a kill goes
        kept = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                if json.loads(line)["step"] <= r.progress["step"]:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                pass
        checkpoint.write_file(path, "".join(kept))
    checkpoint.write_file(r.out / "config.yaml", "")  # a folder that takes no files fails here
    save_config(r.cfg, r.out / "config.yaml")
    if r.cfg.wandb.mode != "disabled":
        import wandb

        w = r.cfg.wandb
        strategy = r.cfg.replay.strategy
        run_id = r.progress["wandb_id"]
        r.wandb = wandb.init(project=w.project, group=w.group or None,
                             name=w.name or f"{strategy}-s{r.cfg.seed}", tags=[strategy],
                             config=flat_dict(r.cfg), dir=str(r.out), mode=w.mode, id=run_id,
                             resume="allow" if run_id else None)
        r.progress["wandb_id"] = r.wandb.id
    return open(path, "a")


def row_entropy(r: Run, rows: Rollouts) -> torch.Tensor:
    """(B,) the policy's mean token entropy of each row; every rank calls it together."""
    n = len(rows)
    if n == 0:  # a stand-in row runs, so every rank's passes match; its value is dropped
        rows = pack([Row([0, 0], 1, [0.0], False, 0.0)], 0, torch.zeros(1), torch.zeros(1), 0)
    _, ent = grpo.no_grad_logprobs(r.model, rows, r.settings, r.compute, r.device,
                                   with_entropy=True)
    return (ent.sum(1) / rows.completion_len.clamp(min=1))[:n]


def run_eval(r: Run) -> dict:
    """Held-out eval, each rank's share from its own fixed seed (how often we evaluate never changes
    training randomness); every rank gets the summary of all. A stop abandons it (Interrupted)."""
    e = r.cfg.eval
    sampling = replace(r.cfg.rollout, group_size=e.k, temperature=e.temperature, top_p=e.top_p,
                       top_k=0, max_new_tokens=e.max_new_tokens or r.cfg.rollout.max_new_tokens)
    sync_engine(r, {})
    desc = f"eval {r.progress['step']}" if r.rank == 0 else None  # a bar: a real eval takes minutes
    devices = [r.device] if r.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), full_weights(r.model, r.compute):
        torch.manual_seed(r.cfg.seed + r.rank)
        prompts = r.eval_prompts[r.rank :: r.world]
        golds = r.eval_golds[r.rank :: r.world]
        with abandonable():
            records = evaluate(r.model, r.tokenizer, prompts, golds, sampling, r.cfg.reward, r.stop,
                               desc, leave=False, engine=r.engine, key=("eval", r.cfg.seed, r.rank))
    if dist.is_initialized():
        parts = [None] * r.world
        dist.all_gather_object(parts, records)
        records = [x for part in parts for x in part]
    return summarize(records)


# ------------------------------------------------------------------------------------- the loop


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> int:
    """Set up, run the loop, finish; returns the exit code (0, or 143 / 130 after SIGTERM / SIGINT).
    A failed write (a full disk) is one line naming the checkpoint to resume from."""
    STOP.install()  # a signal is a request from here on (during set-up too)
    r = setup(cfg, resume, overwrite)
    try:
        if r.rank == 0:  # out_dir is claimed only now, everything loaded and checked
            r.lock = checkpoint.claim_out_dir(r.out, overwrite)
            r.log = open_log(r, resume is not None)
        if dist.is_initialized():
            dist.barrier()
        return finish(r, loop(r))
    except BaseException as e:
        if r.lock is not None and checkpoint.aside(r.out).is_dir():  # failed before a first step
            checkpoint.put_back(r.out)
        if isinstance(e, OSError):
            raise RunError(f"{oneline(e)}; {checkpoint.intact(r.out)}") from None
        if isinstance(e, FloatingPointError):
            last = checkpoints(r.out)
            good = f"{last[-1].name}: --resume={last[-1].name} with a lower lr" if last else "none"
            raise RunError(f"{e} at step {r.progress['step'] + 1} (optim.lr too high?); "
                           f"the last good checkpoint is {good}") from None
        raise
    finally:
        for f in (r.log, r.lock):
            if f is not None:
                f.close()
        if r.engine is not None:  # first: vLLM tears down its groups (and a world it made)
            r.engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()


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
    """Generation steps until max_steps or a stop (SIGTERM, SIGINT: preempt.py), which abandons the
    rollout or the eval under way (--resume redoes it) but lets an update finish (its time is
    bounded); returns the signal number (0: ran to the end)."""
    cfg, p = r.cfg, r.progress
    try:
        if p["step"] == 0:
            p["eval_initial"] = p["eval_last"] = run_eval(r)
        t_run = time.time() - p["wall"]
        if p["pending_row"]:  # a stop cut the last step's eval short
            end_step(r, t_run)
    except Interrupted:
        return STOP.signum
    bar = tqdm(range(p["step"], cfg.max_steps), initial=p["step"], total=cfg.max_steps,
               disable=r.rank > 0)
    for step in bar:
        t = {}
        done = rollout_or_rewind(r, step, t)  # 1-2. rollout and reward
        if done is None:
            break
        fresh, rounds, generated = done
        if r.engine is not None:  # GPU: the KV cache is freed while the trainer needs the memory
            r.engine.sleep()
        p["generated_tokens"] += generated
        # 3. Advantages within each group (RLEP, ExGRPO first add stored rows to groups)
        with timed(t, "advantage"):
            fresh = r.replay.before_advantages(fresh, step)
            fresh.advantage, adv_metrics = grpo.group_advantages(
                fresh.reward, fresh.group, cfg.grpo.adv_scale, cfg.grpo.adv_eps)
        with timed(t, "replay_sample"):  # 4. Replay: the update batch, fresh rows and stored ones
            batch = r.replay.sample(fresh, step)
        for group in r.optimizer.param_groups:  # the schedule counts generation steps
            group["lr"] = get_lr(step, cfg)
        # 5. Update: optim.minibatches optimizer steps, each of micro-batches. A stop waits for it.
        update, entropy, skipped, times = grpo.update_policy(
            r.settings, r.model, r.policy, r.optimizer, batch, r.device, r.compute, r.ref)
        t |= times
        r.optimizer_steps += sum(reason is None for reason in skipped)
        with timed(t, "replay_push"):  # 6. Replay push: the batch, with each row's entropy now
            r.replay.push(batch, step, entropy)
        # 7. Log one line (8. after the eval, every eval.every steps and at the end)
        p["step"] = step + 1
        local = {**adv_metrics, **rounds, **r.replay.metrics()}
        p["pending_row"] = log_row(r, step, fresh, batch, update, skipped, local, t)
        try:
            row = end_step(r, t_run)
        except Interrupted:  # the step is done: the checkpoint keeps its line for --resume
            break
        # 9. Checkpoint every checkpoint.every steps and at the end
        every = cfg.checkpoint.every
        if every and ((step + 1) % every == 0 or step + 1 == cfg.max_steps):
            checkpoint.save_checkpoint(r.out, cfg, r.model, r.tokenizer, r.optimizer, r.replay, p)
        if r.rank == 0:  # the new run has a step: a run --overwrite set aside goes
            checkpoint.drop_aside(r.out)
        accuracy = p["eval_last"].get("accuracy", math.nan)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", eval=f"{accuracy:.3f}")
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
    if r.rank == 0:
        line = row | {"wall_seconds": p["wall"]}
        r.log.write(json.dumps(line) + "\n")
        r.log.flush()
        if r.wandb:
            r.wandb.log(line, step=line["step"])
    p["pending_row"] = None
    return row


def rollout_or_rewind(r: Run, step: int, t: dict) -> tuple[Rollouts, dict, int] | None:
    """rollout(), or None when a stop abandoned it (or came during the reward): the RNG streams, the
    data position and the replay sampler are put back, so a checkpoint now is this step's start."""
    rng = checkpoint.rng_state()
    data_pos = r.progress["data_pos"]
    sampler = r.replay.gen.get_state()  # (exgrpo's plan draws from it)
    try:
        done = rollout(r, step, t)
        if STOP.agreed():
            raise Interrupted
        return done
    except Interrupted:
        checkpoint.set_rng_state(rng)
        r.progress["data_pos"] = data_pos
        r.replay.gen.set_state(sampler)
        return None


def rollout(r: Run, step: int, t: dict) -> tuple[Rollouts, dict, int]:
    """This step's fresh rows, rewarded, their metrics and the tokens generated (all ranks'). Under
    rollout.dynamic_sampling = N > 0 (DAPO), up to N rounds run until every rank holds its share of
    groups with a reward spread; a capped step fills up with flat groups."""
    cfg, p = r.cfg, r.progress
    G = cfg.rollout.group_size
    rounds = max(1, cfg.rollout.dynamic_sampling)
    n = cfg.rollout.batch_size // G  # prompts per round, over every rank
    kept, spare, generated = [], [], 0
    for rnd in range(rounds):
        sync_engine(r, t)
        with timed(t, "generate"):
            idx = prompt_order(len(r.prompts), p["data_pos"], n, cfg.seed)[r.rank :: r.world]
            counts = [G] * len(idx)
            if rnd == 0:  # replay may replace prompts with stored ones
                idx, counts = r.replay.plan(idx, G, step)
            p["data_pos"] += n
            with full_weights(r.model, r.compute), abandonable():  # a stop: Interrupted, all ranks
                fresh, texts = sample(r, idx, step, counts, (step * rounds + rnd) * n, rnd)
            generated += int(all_ranks(float(fresh.completion_len.sum())))
        with timed(t, "reward"):
            golds = [r.golds[i] for i in fresh.prompt_idx.tolist()]
            rewards, correct, metrics = score_batch(texts, golds, cfg.reward)
            penalty = overlong_penalty(fresh.completion_len, cfg.rollout.max_new_tokens, cfg.reward)
            fresh.reward = torch.tensor(rewards) + penalty
            fresh.correct = torch.tensor(correct)
        if not cfg.rollout.dynamic_sampling:
            return fresh, metrics, generated
        flat = grpo.flat_groups(fresh.reward, fresh.group)
        kept.append(fresh.select(~flat))
        spare.append(fresh.select(flat))
        groups = sum(len(set(k.group.tolist())) for k in kept)
        if all_ranks(float(groups >= n // r.world), dist.ReduceOp.MIN):
            break
    fresh = Rollouts.cat(kept + spare, r.tokenizer.pad_token_id)  # informative groups first
    use = torch.tensor(list(dict.fromkeys(fresh.group.tolist()))[: n // r.world])
    chosen = torch.isin(fresh.group, use)
    capped = bool(grpo.flat_groups(fresh.reward, fresh.group)[chosen].any())
    metrics |= {"dynamic/rounds": rnd + 1.0, "dynamic/capped": float(capped),
                "dynamic/groups_dropped": float(fresh.group.unique().numel() - len(use))}
    return fresh.select(chosen), metrics, generated


def sample(r: Run, idx: list, step: int, counts: list, group0: int, rnd: int) -> tuple:
    """(Rollouts, texts) of prompts `idx`: HF generate, or the engine (seeded per request)."""
    prompts = [r.prompts[i] for i in idx]
    if r.engine is None:
        return generate(r.model, r.tokenizer, prompts, r.cfg.rollout, r.stop, idx, step, counts,
                        group0=group0)
    key = ("train", r.cfg.seed, step, rnd, r.rank)
    ro, texts = r.engine.generate(r.tokenizer, prompts, r.cfg.rollout, r.stop, idx, step, counts,
                                  group0, key)
    vllm_engine.fill_entropy(ro, r.model, r.cfg.rollout.temperature, r.device)
    return ro, texts


def log_row(r: Run, step: int, fresh: Rollouts, batch: Rollouts, update: dict, skipped: list,
            local: dict, t: dict) -> dict:
    """One metrics line: fresh rows' statistics summed over ranks, the update's metrics, this rank's
    own ones (advantages, verifier, replay, dynamic sampling) averaged over ranks, phase times."""
    p = r.progress
    n = fresh.completion_len.double()
    sums = {"tokens": n.sum(), "rows": torch.tensor(len(fresh)),
            "reward": fresh.reward.double().sum(), "correct": fresh.correct.sum(),
            "truncated": fresh.truncated.sum(), "entropy": (fresh.entropy.double() * n).sum(),
            "replayed": batch.replayed.sum(),
            "replayed_tokens": batch.completion_len[batch.replayed].sum(),
            "batch_tokens": batch.completion_len.sum()}
    s = dict(zip(sums, all_ranks(torch.stack(list(sums.values())).double())))
    keys = sorted(local)
    means = all_ranks(torch.tensor([float(local[k]) for k in keys])) / r.world
    p["trained_tokens"] += int(update["tokens"])
    for reason in filter(None, skipped):
        p["skipped"][reason] = p["skipped"].get(reason, 0) + 1  # older checkpoints lack "gated"
    row = {"step": step + 1,
           "generated_tokens": p["generated_tokens"],
           "tokens/trained": p["trained_tokens"],
           "tokens/generated_total": p["generated_tokens"] + p["source_tokens"],
           "reward_mean": (s["reward"] / s["rows"]).item(),
           "correct_mean": (s["correct"] / s["rows"]).item(),
           "response_len": (s["tokens"] / s["rows"]).item(),
           "truncated_frac": (s["truncated"] / s["rows"]).item(),
           "entropy/fresh": (s["entropy"] / s["tokens"].clamp(min=1)).item(),
           "replay/rows": int(s["replayed"]),
           "replay/token_share": (s["replayed_tokens"] / s["batch_tokens"].clamp(min=1)).item()}
    row |= {k: v for k, v in update.items() if k != "tokens"}
    row |= dict(zip(keys, means.tolist()))
    row["lr"] = r.optimizer.param_groups[0]["lr"]
    row |= {f"skipped/{k}": v for k, v in p["skipped"].items()}
    row |= {f"time/{k}": v for k, v in t.items()}
    row["time/step"] = sum(t.values())
    return row


def finish(r: Run, signum: int) -> int:
    """SIGTERM: a checkpoint; SIGINT: a note where to resume; otherwise final/ and summary.json."""
    p = r.progress
    last = checkpoints(r.out)
    if signum == signal.SIGTERM and not (last and last[-1].name == f"step_{p['step']:06d}"):
        checkpoint.save_checkpoint(r.out, r.cfg, r.model, r.tokenizer, r.optimizer, r.replay, p)
    if signum:
        last = checkpoints(r.out)
        where = f"--resume continues from {last[-1].name}" if last else "no checkpoint yet"
        if p["pending_row"] and signum == signal.SIGTERM:
            where += f" (with the eval of step {p['step']}, cut short)"
        name = signal.Signals(signum).name
        print(f"\nstopped by {name} after step {p['step']}; {where}", file=sys.stderr)
        return 128 + signum
    dtype = getattr(torch, r.cfg.model.compute_dtype)
    save_model(r.model, r.tokenizer, r.out / "final", dtype=dtype)
    if r.rank == 0:
        summary = {"strategy": r.cfg.replay.strategy, "seed": r.cfg.seed, "steps": r.cfg.max_steps,
                   "eval_accuracy_initial": p["eval_initial"].get("accuracy"),
                   "eval_accuracy_final": p["eval_last"].get("accuracy"),
                   "eval_response_len_final": p["eval_last"].get("response_len"),
                   "eval_entropy_final": p["eval_last"].get("entropy"),
                   "generated_tokens": p["generated_tokens"],
                   "tokens_trained": p["trained_tokens"],
                   "tokens_generated_total": p["generated_tokens"] + p["source_tokens"],
                   "wall_seconds": p["wall"],
                   "skipped_updates": p["skipped"]}
        checkpoint.write_file(r.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        checkpoint.drop_aside(r.out)  # a run of 0 steps
        if r.wandb:
            r.wandb.summary.update(summary)
            r.wandb.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
