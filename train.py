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

import functools
import json
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import grpo
from batch import Rollouts
from config import (Config, ConfigError, check_rules, get_lr, load_config, split_flags,
                    update_settings, validate)
from data.loaders import load_task, problems_digest, prompt_stream
from eval import run_eval
from methods import compose_rollout, compose_update
from metrics import COUNTERS, Progress, RunLog, log_row, timed
from replay import buffers, make_replay, row_entropy
from rewards import overlong_penalty, score_batch
from rollout import make_sampler
from support import checkpoint, parallel
from support.checks import budget, sizes
from support.models import load_run_model, save_model
from support.parallel import all_ranks
from support.preempt import (STOP, Interrupted, StepStart, StoppedInSetup, generating, rewind,
                             setting_up, stopped_in_setup)
from support.prompts import chat_prompts, end_ids
from support.rundir import RunFolder, write_file
from support.util import (RunError, command_errors, library_versions, other_versions, reworded,
                          seed_all, torch_dtype)


def main(argv: list[str]) -> int:
    flags, overrides = split_flags(argv, ("--resume", "--overwrite", "--debug"))
    try:
        with command_errors("", "--debug" in flags, (ConfigError, RunError)):
            cfg = load_config(None, overrides)
            validate(cfg)
            if "--resume" in flags and "--overwrite" in flags:
                raise ConfigError("--resume and --overwrite exclude each other")
            return train(cfg, resume=flags.get("--resume"), overwrite="--overwrite" in flags)
    except SystemExit as e:  # bad input, said on one line
        return e.code


# ------------------------------------------------------------------------------------- set-up


@dataclass
class Run:
    """What set-up builds and the loop uses."""

    cfg: Config
    out: Path
    rank: int  # this process, of `world` (torchrun; 0 of 1 without)
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
    settings: grpo.UpdateSettings  # what grpo's update and no-grad passes read of cfg
    progress: Progress = field(default_factory=Progress)  # saved in checkpoints
    sampler: object = None  # rollout.HFSampler, or support/vllm.py's VLLMSampler
    rollout: object = None  # the rollout phase (compose_rollout): one_round, or DAPO's rounds
    choose: object = None  # the next prompts: data.loaders.next_prompts, or GRESO's skipping
    complete: object = None  # a round's generate-and-reward: plain_complete, or staged rollouts
    update: object = None  # the update phase: grpo.update_policy, or a method that replaces it
    methods: dict = field(default_factory=dict)  # the methods that are on and keep state: saved
    observers: list = field(default_factory=list)  # methods on that learn from each rollout
    generators: list = field(default_factory=list)  # RNGs a stop puts back with the rollout
    notes: list = field(default_factory=list)  # set-up's notes, printed once it has succeeded
    folder: RunFolder = None  # out_dir, locked by rank 0 from the start of set-up to the end
    log: RunLog = None  # metrics.jsonl and wandb (metrics.py; rank 0's writes)


def setup(cfg: Config, resume: str | None, overwrite: bool) -> Run:
    """Lock and check out_dir, then build the run in it: a failure leaves out_dir as it was."""
    rank, world = parallel.init()
    parallel.check_share(cfg.rollout.batch_size // cfg.rollout.group_size)
    folder = RunFolder(cfg.out_dir, rank)
    with folder.setting_up(resume, overwrite), setting_up():  # (one run of two on one folder)
        r = build(cfg, resume, folder.out, rank, world)
    r.folder = folder
    return r


def build(cfg: Config, resume: str | None, out: Path, rank: int, world: int) -> Run:
    """Load data and model, restore a checkpoint (train() then claims out_dir)."""
    ck, state = None, {}
    if resume is not None:
        ck, state = checkpoint.find_checkpoint(out, resume, rank)
    seed_all(cfg.seed, rank, cfg.threads)
    # The data before the model: a bad file fails fast
    with reworded("data: ", ValueError, TypeError, OSError, ImportError):
        problems, eval_problems = load_task(cfg.data, cfg.eval.n)
    path = str(ck) if ck else cfg.model.path
    device, (model, policy, tokenizer, ref, compute) = load_run_model(cfg, path, world, ck)
    with reworded("", ValueError):  # a stop token that is not one
        stop = end_ids(tokenizer, model, cfg.data.chat_template, cfg.rollout.stop_tokens)
    sets, notes = chat_prompts(cfg, tokenizer, model, path, (problems, eval_problems))
    (prompts, problems, _), (eval_prompts, eval_problems, _) = sets
    trained = [p for p in model.parameters() if p.requires_grad]  # under LoRA, the adapters alone
    betas = (cfg.optim.beta1, cfg.optim.beta2)
    optimizer = torch.optim.AdamW(trained, lr=cfg.optim.lr, betas=betas,
                                  weight_decay=cfg.optim.weight_decay)
    max_len = max(map(len, prompts)) + cfg.rollout.max_new_tokens  # (before a buffer exists)
    check_rules(cfg, budget(cfg, len(eval_prompts), sizes(max_len, buffers(cfg.replay))))
    replay = make_replay(cfg.replay, max_len, tokenizer.pad_token_id, cfg.seed + rank)
    r = Run(cfg=cfg, out=out, rank=rank, world=world, device=device, model=model, policy=policy,
            tokenizer=tokenizer, ref=ref, compute=compute, optimizer=optimizer, replay=replay,
            prompts=prompts, golds=[p.answer for p in problems], eval_prompts=eval_prompts,
            eval_golds=[p.answer for p in eval_problems], settings=update_settings(cfg),
            notes=notes, progress=Progress(problems_digest(problems)))
    new_tokens = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    longest = max(map(len, prompts + eval_prompts)) + new_tokens
    r.sampler = make_sampler(cfg.rollout.engine, model=model, tokenizer=tokenizer, stop=stop,
                             path=cfg.model.path, sampling=cfg.rollout,
                             dtype=torch_dtype(cfg.model.compute_dtype), longest=longest,
                             trust_remote_code=cfg.model.trust_remote_code,
                             adapted=cfg.model.lora.rank > 0)
    entropy = functools.partial(row_entropy, model, settings=r.settings, compute=compute,
                                device=device)  # the replay strategies that score stored rows
    with reworded("replay: ", ValueError, OSError):  # RLEP's source file
        r.progress.source_tokens = replay.start(problems, prompts, tokenizer, cfg, entropy)
    # The phases, each plain GRPO's or a method's that replaces or wraps it (methods/__init__.py)
    r.generators = [replay.gen]  # put back when a stop rewinds a step's rollout
    r.choose, r.complete, r.rollout = compose_rollout(
        cfg, len(prompts), tokenizer.pad_token_id, functools.partial(one_round, r), plain_complete,
        r.methods, r.observers, r.generators)
    r.update = compose_update(cfg, r.methods)
    if ck:
        note, saved = checkpoint.restore(ck, state, cfg, model, optimizer, replay, r.progress,
                                         r.methods)
        r.progress = r.progress.resumed(saved)  # the step, the data position, the counts, evals
        r.notes.append(note)
    return r


# ------------------------------------------------------------------------------------- the loop


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> int:
    """Set up, run the loop, finish; returns the exit code (0, or 143 / 130 after SIGTERM / SIGINT).
    A failed write (a full disk) is one line naming the checkpoint to resume from."""
    STOP.install()  # a signal ends set-up at once, and is a request to the loop after it
    try:
        r = setup(cfg, resume, overwrite)
    except StoppedInSetup:
        return stopped_in_setup()
    try:
        r.folder.claim(overwrite)  # everything loaded and checked: the run starts writing
        if library_versions() not in r.progress.versions:  # a resume on other versions: both
            r.notes += other_versions(r.progress.versions, library_versions())
            r.progress.versions.append(library_versions())
        r.log = r.folder.open_log(cfg, r.progress.step, r.progress.wandb_id, resume is not None)
        r.progress.wandb_id = r.log.wandb_id
        parallel.barrier()
        if r.rank == 0 and r.notes:
            print("\n".join(r.notes), file=sys.stderr)
        return finish(r, loop(r))
    except BaseException as e:
        r.folder.failed()  # before it was under way: out_dir as set-up found it
        said = checkpoint.failure(e, r.out, r.progress.step)  # a full disk, diverged weights
        if said is None:  # a bug: its traceback
            raise
        raise said from None
    finally:
        if r.log is not None:
            r.log.close()
        r.folder.close()
        r.sampler.close()  # first: vLLM tears down its groups (and a world it made)
        r.policy = None  # DDP's wrapper goes before its process group (parallel.close)
        parallel.close()


def loop(r: Run) -> int:
    """Generation steps until max_steps or a stop (SIGTERM, SIGINT: support/preempt.py), which
    abandons the rollout, the eval or an update of several passes under way (--resume redoes it)
    but lets an update of one pass finish (one batch's time: docs/reliability.md); returns the
    signal number (0: ran to the end)."""
    cfg, p = r.cfg, r.progress
    t_run = begin(r)
    if t_run is None:
        return STOP.signum
    start = p.step
    bar = tqdm(range(start, cfg.max_steps), initial=start, total=cfg.max_steps, disable=r.rank > 0)
    for step in bar:
        t = {}
        # 1-2. Rollout: G completions per prompt, rewarded. A stop puts the step back as it was.
        data_pos, start_state = p.data_pos, step_start(r)
        with rewind(r.generators) as rewound:
            fresh, rollout_metrics, generated, _ = r.rollout(step, t)
        if rewound.stopped:
            p.data_pos = data_pos  # --resume takes this step's prompts again
            break
        r.sampler.sleep()  # vLLM on a GPU frees its KV cache while the update needs the memory
        p.generated_tokens += generated
        # The methods on that learn from the rollout (GRESO's group means, stages' successes)
        for method in r.observers:
            method.observe(fresh)
        # 3. Advantages within each group (RLEP and ExGRPO first add stored rows to the groups)
        with timed(t, "advantage"):
            groups = r.replay.before_advantages(fresh, step)
            groups.advantage, adv_metrics = grpo.group_advantages(
                groups.reward, groups.group, cfg.grpo.adv_scale, cfg.grpo.adv_eps)
        # 4. Replay: the update batch, these rows and stored ones
        with timed(t, "replay_sample"):
            batch = r.replay.sample(groups, step)
        # 5. Update at this generation step's learning rate: passes of mini- and micro-batches
        for group in r.optimizer.param_groups:
            group["lr"] = get_lr(step, cfg)
        try:
            update, entropy, skipped, times = r.update(r.settings, r.model, r.policy, r.optimizer,
                                                       batch, r.device, r.compute, r.ref)
        except Interrupted:  # a stop between optimizer steps of several passes: the step's start
            r.progress = start_state.put_back(r.model, r.optimizer, state_of(r), r.generators)
            break
        t |= times
        with timed(t, "weight_sync"):  # the sampler takes the new weights (HF: it has them)
            r.sampler.sync(r.model)
        # 6. Replay push: the batch, with each row's entropy from the update
        with timed(t, "replay_push"):
            r.replay.push(batch, step, entropy)
        # 7. One metrics line (metrics.py), written after 8., the eval (every eval.every steps)
        record_step(r, step, groups, batch, update, skipped, adv_metrics | rollout_metrics, t)
        try:
            row = end_step(r, t_run)
        except Interrupted:  # the step is done: the checkpoint keeps its line for --resume
            break
        checkpoint_if_due(r, first=step == start)  # 9. Checkpoint: checkpoint.every, the end
        accuracy = p.eval_last.get("accuracy", math.nan)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", eval=f"{accuracy:.3f}")
        if STOP.agreed():
            break
    return STOP.agreed()  # (the same answer on every rank, even for a signal during the last step)


def step_start(r: Run) -> StepStart | None:
    """The step's start, kept when its update runs several passes (a stop may end it: loop)."""
    if not r.settings.stoppable:
        return None
    return StepStart(r.model, r.optimizer, state_of(r), r.generators, r.progress)


def state_of(r: Run) -> list:
    """What a checkpoint saves of the run beside its weights: the replay, the methods' states."""
    return [r.replay, *r.methods.values()]


def finish(r: Run, signum: int) -> int:
    """The run's end: after SIGTERM a checkpoint (unless the step's is there), after SIGINT a note
    where to resume; otherwise final/ and summary.json. Returns the exit code."""
    p = r.progress
    if signum:
        if signum == signal.SIGTERM and not checkpoint.saved_at(r.out, p.step):
            checkpoint.save_checkpoint(r.out, r.cfg, r.model, r.tokenizer, r.optimizer, r.replay,
                                       p, r.methods)
        checkpoint.stopped(r.out, p, signum)
        r.folder.commit()  # a resume's files: what the next --resume cuts back from
        return 128 + signum
    save_model(r.model, r.tokenizer, r.out / "final", dtype=torch_dtype(r.cfg.model.compute_dtype))
    if r.rank == 0:
        summary = checkpoint.summary(r.cfg, p)
        write_file(r.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        r.folder.step_done(saved=True)  # a run of 0 steps: the old run goes, a resume's files in
        r.log.finish(summary)
    return 0


def record_step(r: Run, step: int, groups: Rollouts, batch: Rollouts, update: dict, skipped: list,
                local: dict, t: dict) -> None:
    """Step `step` done: the progress counts it (the update's tokens and rows, metrics.COUNTERS,
    and why steps were skipped) and keeps its metrics line (`local`: this rank's own metrics, the
    replay's and the observing methods' added) until end_step writes it."""
    p = r.progress
    p.step = step + 1
    local = local | r.replay.metrics()
    for method in r.observers:
        local |= method.metrics()
    for counter, key in COUNTERS.items():  # the update's compute, summed over the run
        setattr(p, counter, getattr(p, counter) + int(update[key]))
    for reason in filter(None, skipped):
        p.skipped[reason] = p.skipped.get(reason, 0) + 1  # older checkpoints lack "gated"
    lr = r.optimizer.param_groups[0]["lr"]
    p.pending_row = log_row(p, r.world, lr, step, groups, batch, update, local, t)


def checkpoint_if_due(r: Run, first: bool) -> None:
    """A checkpoint of the step just done every checkpoint.every steps and after the last; the run
    folder then settles: an --overwrite's old run goes after this run's first step, a resume's
    files once a checkpoint holds them."""
    every, step = r.cfg.checkpoint.every, r.progress.step
    saved = every > 0 and (step % every == 0 or step == r.cfg.max_steps)
    if saved:
        checkpoint.save_checkpoint(r.out, r.cfg, r.model, r.tokenizer, r.optimizer, r.replay,
                                   r.progress, r.methods)
    if saved or first:
        r.folder.step_done(saved)


def begin(r: Run) -> float | None:
    """Before the first step: the step-0 eval of a new run, and the line of a step whose eval a
    stop cut short. Returns the run's start on the wall clock, or None after a stop."""
    p = r.progress
    try:
        if p.step == 0:
            p.eval_initial = p.eval_last = held_out_eval(r)
        t_run = time.time() - p.wall
        if p.pending_row:
            end_step(r, t_run)
    except Interrupted:
        return None
    return t_run


def held_out_eval(r: Run) -> dict:
    """The periodic eval (eval.py's run_eval) of the policy as it is now."""
    return run_eval(r.sampler, r.model, r.compute, r.device, r.eval_prompts, r.eval_golds, r.cfg,
                    r.progress.step, r.rank)


def end_step(r: Run, t_run: float) -> dict:
    """The finished step's eval when due, then its metrics line (kept in progress until written)."""
    cfg, p, row = r.cfg, r.progress, r.progress.pending_row
    if (cfg.eval.every and p.step % cfg.eval.every == 0) or p.step == cfg.max_steps:
        t0 = time.perf_counter()
        p.eval_last = held_out_eval(r)
        evals = {f"eval/{k}": v for k, v in p.eval_last.items()}
        row = row | evals | {"time/eval": time.perf_counter() - t0}
    p.wall = time.time() - t_run
    r.log.write(row | {"wall_seconds": p.wall})  # rank 0's metrics.jsonl and wandb
    p.pending_row = None
    return row


def one_round(r: Run, step: int, t: dict, rnd: int = 0, rounds: int = 1) -> tuple:
    """A round of the rollout: the next prompts (the data order, or GRESO's skipping), a replay
    plan (RLEP and ExGRPO may replace prompts with stored ones; first round only), then each
    prompt's completions generated and rewarded. Returns the rows, their metrics, the tokens
    generated on every rank and this rank's number of prompts."""
    cfg, p = r.cfg, r.progress
    G = cfg.rollout.group_size
    n = cfg.rollout.batch_size // G  # prompts per round, over every rank
    choice = r.choose(prompt_stream(len(r.prompts), p.data_pos, cfg.seed), n)
    p.data_pos += choice.consumed
    idx = parallel.share(choice.prompts)
    mine = len(idx)  # this rank's prompts
    counts = [G] * len(idx)
    if rnd == 0:
        idx, counts = r.replay.plan(idx, G, step)
    group0 = (step * rounds + rnd) * n  # counts[i] completions of idx[i] in group group0 + i
    key = ("train", cfg.seed, step, rnd, r.rank)  # an engine's seeds
    generate = functools.partial(generate_and_reward, r, idx, step, group0, t=t)
    fresh, metrics = r.complete(generate, counts, key)
    generated = int(all_ranks(float(fresh.completion_len[~fresh.replayed].sum())))
    return fresh, metrics, generated, mine


def plain_complete(generate, counts: list[int], key: tuple) -> tuple[Rollouts, dict]:
    """counts[i] completions of each prompt, rewarded, and the verifier's metrics: one call of
    `generate` (staged rollouts, methods/stages.py, replace it)."""
    return generate(counts, key)


def generate_and_reward(r: Run, idx: list[int], step: int, group0: int, counts: list[int],
                        key: tuple, t: dict) -> tuple[Rollouts, dict]:
    """counts[i] completions of prompt idx[i] in group group0 + i, each rewarded (the verifier's
    reward, plus the overlong penalty), and the verifier's metrics."""
    prompts = [r.prompts[i] for i in idx]
    with timed(t, "generate"), generating(r.model, r.compute):  # a stop: Interrupted
        fresh, texts = r.sampler.generate(prompts, r.cfg.rollout, idx, step, counts, group0, key)
    with timed(t, "reward"):  # rewards.py's score against each row's gold answer
        golds = [r.golds[i] for i in fresh.prompt_idx.tolist()]
        rewards, correct, verifier, _ = score_batch(texts, golds, r.cfg.reward)
        # DAPO's overlong penalty (when reward.overlong_buffer is set)
        penalty = overlong_penalty(fresh.completion_len, r.cfg.rollout.max_new_tokens, r.cfg.reward)
        fresh.reward = torch.tensor(rewards) + penalty
        fresh.correct = torch.tensor(correct, dtype=torch.bool)
    return fresh, verifier


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
