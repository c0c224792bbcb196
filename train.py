"""GRPO with experience replay, in one flat loop.

Usage:
  python train.py --config configs/tiny.yaml --out_dir=runs/tiny                 # embedded model + task, CPU
  python train.py --config configs/tiny.yaml --replay.strategy=aper --seed=1      # flip one key
  python train.py --config configs/tiny.yaml --out_dir=runs/tiny --resume         # continue after a kill
  torchrun --nproc_per_node=2 train.py --config configs/tiny.yaml --out_dir=runs/ddp

Flags: --config FILE, --resume (continue from out_dir's latest checkpoint), --overwrite (start over in a
non-empty out_dir), --debug (show tracebacks). Everything else is a dotted config override (config.py).

One step, in order: rollout (HF generate, G samples per prompt, behaviour log-probs kept) → reward
(rewards.py) → advantages (grpo.py; RLEP first appends replayed successes to each group) → replay sample
(replay.py) → update on fresh ∪ replayed in mini-batches × micro-batches → replay push → log → eval →
checkpoint. Bad input prints one line and exits 2.

Each metrics.jsonl line times the step's phases (seconds): time/generate (behaviour log-probs are recorded while
sampling, no extra pass), reward, advantage, replay_sample, prox_logprobs (a no-grad pass, only when
optim.minibatches > 1), ref_logprobs (only when grpo.beta > 0), forward_backward, optimizer, replay_push, other
(bookkeeping between them); time/step is the step's wall clock without eval, and time/eval is logged apart.

Under torchrun each rank generates for its share of the step's prompts (prompts[rank::world]) and keeps its own
replay buffer (capacity, priorities and staleness bounds are per rank; it stores and replays only that rank's
rollouts); gradients are all-reduced by DDP so every rank applies the global batch's update. Rank 0 alone logs,
evaluates (the others wait at a barrier) and writes checkpoints, which hold every rank's buffer and RNG state.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import random
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo
from config import Config, ConfigError, load_config, save_config, to_dict, validate
from config import flatten as _flat
from data.loaders import load_problems, read_jsonl
from eval import evaluate
from replay import make_replay
from rewards import score_batch
from rollout import Rollouts, format_prompt, generate, rollouts_from_texts

RUN_FLAGS = ("--resume", "--overwrite", "--debug")


class RunError(Exception):
    """Bad input found while setting up a run (missing model, empty dataset, ...): one line, exit 2."""


def load_train_eval(cfg: Config):
    d = cfg.data
    tiny = {"max_int": d.tiny_max_int, "max_den": d.tiny_max_den, "kinds": d.tiny_kinds}
    train_spec = "tiny_train" if d.train == "tiny" else d.train
    train = load_problems(train_spec, data_dir=d.data_dir or None, problem_key=d.problem_key or None,
                          answer_key=d.answer_key or None, limit=d.tiny_train_size if d.train == "tiny" else None, tiny=tiny)
    evals = [p for spec in d.eval.split(",") for p in load_problems(spec, data_dir=d.data_dir or None, limit=cfg.eval.n or None, tiny=tiny)]
    return train, evals


def prompt_order(n: int, position: int, count: int, seed: int) -> list[int]:
    """Indices of the next `count` training problems: a fresh seeded permutation each epoch.
    A pure function of the position, so resuming only needs the position."""
    out = []
    while len(out) < count:
        epoch, offset = divmod(position, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        take = perm[offset : offset + count - len(out)]
        out += take
        position += len(take)
    return out


def rng_state() -> dict:
    """Every global RNG as tuples, lists and tensors: the checkpoint then loads with torch.load(weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    s = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def skip_reason(any_signal: bool, loss: float, grad_norm: torch.Tensor) -> str | None:
    """Why an optimizer step must leave the weights alone (a key of the `skipped/*` counters), or None to step.
    All-zero advantages: AdamW would still move the weights (momentum, weight decay) on a zero gradient."""
    if not any_signal:
        return "zero_adv"
    if not (np.isfinite(loss) and bool(torch.isfinite(grad_norm))):
        return "nonfinite"
    return None


def save_checkpoint(out: Path, step: int, model, tokenizer, optimizer, scheduler, replay, state: dict, keep_last: int) -> None:
    """Write checkpoints/step_N atomically: a temporary folder renamed into place, then `latest` updated last.
    A kill at any point leaves `latest` naming a complete checkpoint; a failed write (full disk) removes its
    temporary folder and stops the run with one line."""
    ckdir = out / "checkpoints"
    final, tmp = ckdir / f"step_{step:06d}", ckdir / f".tmp_step_{step:06d}"
    try:
        ckdir.mkdir(exist_ok=True)
        for stale in ckdir.glob(".tmp_step_*"):  # left by a run killed while writing
            shutil.rmtree(stale, ignore_errors=True)
        getattr(model, "module", model).save_pretrained(tmp)  # safetensors
        tokenizer.save_pretrained(tmp)
        trainer_state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "replay": replay.state_dict(),
                         "rng": rng_state(), **state}
        torch.save(trainer_state, tmp / "trainer_state.pt")
        shutil.rmtree(final, ignore_errors=True)  # only exists when a resumed run redoes a step `latest` never named
        os.replace(tmp, final)
        (ckdir / "latest.tmp").write_text(final.name)
        os.replace(ckdir / "latest.tmp", ckdir / "latest")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = (ckdir / "latest").read_text().strip() if (ckdir / "latest").is_file() else None
        raise RunError(f"checkpoint {final} could not be written ({e.strerror or e}); "
                       + (f"{kept} is intact: fix the cause and --resume" if kept else "no earlier checkpoint")) from None
    done = sorted(p for p in ckdir.glob("step_*") if p.is_dir() and p != final)
    for old in done[: max(0, len(done) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str]) -> int:
    flags = {a for a in argv if a in RUN_FLAGS}
    overrides, config_path, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            config_path, i = (argv[i + 1] if i + 1 < len(argv) else ""), i + 1
        elif a.startswith("--config="):
            config_path = a.split("=", 1)[1]
        elif a not in RUN_FLAGS:
            overrides.append(a)
        i += 1
    try:
        if config_path == "":
            raise ConfigError("--config needs a file")
        cfg = load_config(config_path, overrides)
        validate(cfg)
        train(cfg, resume="--resume" in flags, overwrite="--overwrite" in flags)
    except (ConfigError, RunError) as e:  # bad input; any other exception is a bug and keeps its traceback
        if "--debug" in flags:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def checked(what: str, load, *args, **kwargs):
    """Call a loader; a missing or malformed file becomes one RunError line naming `what` (a config key)."""
    try:
        return load(*args, **kwargs)
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met something other than tensors and plain values
        raise RunError(f"{what}: holds objects other than tensors and plain values; refusing to unpickle them") from None
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise RunError(f"{what}: {lines[0]}") from None


def update_policy(cfg: Config, policy, optimizer, scheduler, batch: Rollouts, *, device: torch.device,
                  autocast=None, ref_model=None) -> tuple[list[dict], torch.Tensor, list[str | None], dict]:
    """Step 5 of the loop: `cfg.optim.minibatches` optimizer steps on `batch`, each accumulating micro-batches.

    Returns one metrics dict per optimizer step (loss metrics summed over micro-batches and ranks), each row's mean
    token entropy (NaN for rows not trained on), why each optimizer step was skipped (None when it was taken), and
    seconds per phase. Under torchrun `policy` is the DDP module and `batch` this rank's rows: the loss normalisers
    are totals over all ranks, so the gradient DDP averages (hence `loss * world`) is that of the global batch.
    Waste avoided, none of it changing the gradient: rows with advantage 0 are not run at all when beta = 0
    (optim.skip_zero_adv), micro-batches hold rows of similar length, and each prompt is run once for its rows
    (grpo.completion_logprobs; not under gradient checkpointing, which drops the KV cache this relies on).
    """
    distributed = isinstance(policy, torch.nn.parallel.DistributedDataParallel)
    world = dist.get_world_size() if distributed else 1
    plain = policy.module if distributed else policy  # no-grad passes need no gradient sync
    share, T = not cfg.model.gradient_checkpointing, cfg.rollout.temperature
    autocast = autocast or nullcontext()
    times = {"prox_logprobs": 0.0, "ref_logprobs": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
    mask_all, comp_len = batch.completion_mask(), batch.completion_len

    def logprobs(model, mu: Rollouts, with_entropy: bool = False, share_prompt: bool = True):
        return grpo.completion_logprobs(model, mu.tokens.to(device), mu.prompt_len.to(device), mu.seq_len.to(device), T,
                                        with_entropy=with_entropy, share_prompt=share_prompt)

    prox_all = None
    if cfg.optim.minibatches > 1:  # later mini-batches need π at the start of the step: one no-grad pass over all rows
        t0 = time.time()
        prox_all = torch.zeros(batch.tokens.shape)
        for rows in torch.argsort(comp_len).split(cfg.optim.logprob_batch_size):
            with torch.no_grad(), autocast:
                lp, _ = logprobs(plain, batch.select(rows), share_prompt=share)
            prox_all[rows, : lp.shape[1]] = lp.float().cpu()
        times["prox_logprobs"] += time.time() - t0

    order = torch.randperm(len(batch)) if cfg.optim.minibatches > 1 else torch.arange(len(batch))
    step_metrics, reasons, row_entropy = [], [], torch.full((len(batch),), float("nan"))
    for mb_rows in order.tensor_split(cfg.optim.minibatches):  # tensor_split: every rank takes the same number of steps
        t0 = time.time()
        # Normalisers are totals over the whole mini-batch (all micro-batches, all ranks), so accumulation
        # gives the full-batch gradient.
        counts = torch.tensor([len(mb_rows), float(mask_all[mb_rows].sum()), float((batch.advantage[mb_rows] != 0).any())])
        if distributed:
            dist.all_reduce(counts)
        n_seqs, n_tokens, any_signal = int(counts[0]), int(counts[1]), bool(counts[2] > 0)
        rows = mb_rows
        if cfg.optim.skip_zero_adv and cfg.grpo.beta == 0:
            rows = mb_rows[batch.advantage[mb_rows] != 0]
            rows = rows if len(rows) else mb_rows[:1]  # one row (gradient exactly 0) keeps this rank in DDP's all-reduce
        micro = rows[torch.argsort(comp_len[rows], stable=True)].split(cfg.optim.micro_batch_size)
        optimizer.zero_grad(set_to_none=True)
        mb_metrics, t_ref = [], 0.0
        for j, mu_rows in enumerate(micro):
            mu = batch.select(mu_rows)
            mask = mu.completion_mask().to(device)
            prox = prox_all[mu_rows, : mu.tokens.shape[1]].to(device) if prox_all is not None else None
            ref = None
            if ref_model is not None:
                t1 = time.time()
                with torch.no_grad(), autocast:
                    ref, _ = logprobs(ref_model, mu)
                t_ref += time.time() - t1
            sync = policy.no_sync() if distributed and j < len(micro) - 1 else nullcontext()  # DDP syncs on the last one
            with sync, autocast:
                logp, ent = logprobs(policy, mu, with_entropy=True, share_prompt=share)
                loss, m = grpo.policy_loss(
                    logp, mu.behav_logp.to(device), mu.advantage.to(device), mask, mu.onpolicy.to(device), cfg.grpo,
                    n_seqs=n_seqs, n_tokens=n_tokens, max_new_tokens=cfg.rollout.max_new_tokens,
                    prox_logp=prox, ref_logp=ref, entropy=ent,
                )
                if any_signal:
                    (loss * world).backward()
            row_entropy[mu_rows] = ((ent.detach() * mask).sum(1) / mask.sum(1).clamp(min=1)).float().cpu()
            mb_metrics.append(m)
        if distributed:  # each rank measured its own rows; the sums in these metrics add up across ranks
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mb_metrics)
            mb_metrics = [m for part in per_rank for m in part]
        times["ref_logprobs"] += t_ref
        times["forward_backward"] += time.time() - t0 - t_ref

        t0 = time.time()
        mb = grpo.combine_metrics(mb_metrics)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf")) if any_signal else torch.tensor(0.0)
        reason = skip_reason(any_signal, mb["loss"], grad_norm)  # all-zero advantages, or a NaN/inf loss or gradient
        if reason is None:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_metrics.append({**mb, "grad_norm": float(grad_norm)})
        reasons.append(reason)
        times["optimizer"] += time.time() - t0
    return step_metrics, row_entropy, reasons, times


def train(cfg: Config, resume: bool = False, overwrite: bool = False) -> dict:
    # ---------------------------------------------------------------- setup
    t_start, wall_offset = time.time(), 0.0
    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:  # torchrun: one process per device; rank 0 alone evaluates, the others wait at a barrier meanwhile
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(hours=2))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    master = rank == 0
    out = Path(cfg.out_dir)
    ckpt_dir = out / "checkpoints"
    latest = ckpt_dir / "latest"
    if resume and not latest.is_file():
        raise RunError(f"--resume: no complete checkpoint in {ckpt_dir} (pass --overwrite instead to start over)")
    if master:  # nothing is deleted here: --overwrite clears out_dir only once every input has loaded
        try:
            if out.exists() and any(out.iterdir()) and not (resume or overwrite):
                raise RunError(f"out_dir {out} is not empty; pass --resume to continue it or --overwrite to start over")
            out.mkdir(parents=True, exist_ok=True)
            probe = out / f".write_test_{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise RunError(f"out_dir {out} is not writable: {e.strerror}") from None
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed + rank)  # ranks sample different completions

    train_problems, eval_problems = checked("data", load_train_eval, cfg)  # before the model: a bad file fails fast
    if not train_problems:
        raise RunError(f"data.train {cfg.data.train!r} holds no problems")

    if cfg.model.device == "auto":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.model.device)
    model_path = cfg.model.path
    hub_id = model_path.count("/") == 1 and not model_path.startswith((".", "/", "~")) and not Path(model_path).parent.is_dir()
    if not Path(model_path).exists() and not hub_id:
        raise RunError(f"model.path {model_path} does not exist (a local folder or an org/name hub id)")
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    # Safe loading: code shipped in the model folder runs only if the config says so; weights load from safetensors
    # (transformers falls back to torch.load with weights_only=True for .bin files).
    load = {"trust_remote_code": cfg.model.trust_remote_code, "dtype": dtype}
    tokenizer = checked(f"model.path {model_path}", AutoTokenizer.from_pretrained, model_path, trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = checked(f"model.path {model_path}", AutoModelForCausalLM.from_pretrained, model_path, **load).to(device)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        model.train()  # HF checkpoints only in training mode; from_pretrained returns eval mode (dropout of LLMs is 0)
    ref_model = None
    if cfg.grpo.beta > 0:  # the frozen reference costs a full model copy: only load it when the KL term is on
        ref_model = AutoModelForCausalLM.from_pretrained(model_path, **load).to(device).eval().requires_grad_(False)
    gen_model = model  # generation always runs on the plain module
    fwd_model = torch.compile(model) if cfg.model.compile else model
    if distributed:
        fwd_model = torch.nn.parallel.DistributedDataParallel(fwd_model, device_ids=[device.index] if device.type == "cuda" else None)
        fwd_model.broadcast_buffers = False  # buffers never change: forwards need no collective, ranks may run different counts
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.model.autocast else nullcontext()

    prompts_all = [format_prompt(tokenizer, p.problem, cfg.data.template) for p in train_problems]
    n_prompts = cfg.rollout.batch_size // cfg.rollout.group_size
    if n_prompts % world:
        raise RunError(f"prompts per step ({n_prompts}) must be divisible by the number of processes ({world})")
    G = cfg.rollout.group_size
    max_len = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts_all) + cfg.rollout.max_new_tokens

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), weight_decay=cfg.optim.weight_decay
    )
    warmup = max(1, cfg.optim.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    replay = make_replay(cfg.replay, max_len=max_len, pad_id=tokenizer.pad_token_id, seed=cfg.seed + rank)
    if cfg.replay.strategy == "rlep" and cfg.replay.rlep_source:
        replay.load_rlep_solutions(checked("replay.rlep_source", rlep_solutions, cfg, tokenizer, train_problems, prompts_all))

    # Run state beyond the weights. The prompt order is a pure function of `data_pos` (prompt_order), so the
    # position is all a resume needs to continue the data stream exactly.
    start_step, data_pos, generated_tokens, skipped, wandb_id, history = 0, 0, 0, {"nonfinite": 0, "zero_adv": 0}, None, {}
    if resume:
        ck = ckpt_dir / latest.read_text().strip()
        state = checked(f"checkpoint {ck}", torch.load, ck / "trainer_state.pt", weights_only=True)  # tensors and plain types only
        changed = sorted(k for k, v in _flat(to_dict(cfg)).items() if _flat(state["config"]).get(k) != v)
        if changed and master:
            print(f"note: resuming with changed config keys: {', '.join(changed)}", file=sys.stderr)
        model.load_state_dict(checked(f"checkpoint {ck}", AutoModelForCausalLM.from_pretrained, ck, **load).state_dict())
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        checked(f"checkpoint {ck} (replay buffer)", replay.load_state_dict, state["replay"])
        set_rng_state(state["rng"])
        if distributed:  # each rank continues its own replay buffer and random streams
            if len(state.get("ranks") or []) != world:
                raise RunError(f"checkpoint {ck} was written by {len(state.get('ranks') or [1])} processes; resume it with as many")
            checked(f"checkpoint {ck} (replay buffer)", replay.load_state_dict, state["ranks"][rank]["replay"])
            set_rng_state(state["ranks"][rank]["rng"])
        if master:
            print(f"resuming from {ck} (step {state['step']})", file=sys.stderr)
        start_step, data_pos, generated_tokens, skipped, wandb_id, history = (
            state["step"], state["data_position"], state["generated_tokens"], state["skipped"], state["wandb_id"], state["history"]
        )
        wall_offset = history.get("wall_before", 0.0)
        if master:  # drop log lines written after the checkpoint (they will be produced again) and a line cut by the kill
            metrics_path, kept = out / "metrics.jsonl", []
            for ln in metrics_path.read_text().splitlines() if metrics_path.exists() else []:
                try:
                    if json.loads(ln)["step"] <= start_step:
                        kept.append(ln + "\n")
                except (ValueError, KeyError, TypeError):
                    pass
            metrics_path.with_suffix(".tmp").write_text("".join(kept))
            os.replace(metrics_path.with_suffix(".tmp"), metrics_path)
    elif master and overwrite:  # every input has loaded: only now is the old run worth giving up
        for p in out.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    run = None
    if master:
        save_config(cfg, out / "config.yaml")
        if cfg.wandb.mode != "disabled":
            import wandb

            run = wandb.init(
                project=cfg.wandb.project,
                group=cfg.wandb.group or None,
                name=cfg.wandb.name or f"{cfg.replay.strategy}-s{cfg.seed}",
                tags=[cfg.replay.strategy],
                config=to_dict(cfg),
                dir=str(out),
                mode=cfg.wandb.mode,
                id=wandb_id,
                resume="allow" if wandb_id else None,
            )
            wandb_id = run.id
    metrics_file = open(out / "metrics.jsonl", "a") if master else None  # noqa: SIM115 (open for the whole run, closed at the end)

    def run_eval() -> dict:
        # Eval draws from its own fixed seed so that how often we evaluate never changes training randomness.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            return evaluate(
                gen_model, tokenizer, eval_problems, k=cfg.eval.k, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
                max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, batch_size=cfg.rollout.gen_batch_size,
                template=cfg.data.template, reward_cfg=cfg.reward,
            )

    if start_step == 0 and master:
        history["eval_initial"] = run_eval()
    if distributed:
        dist.barrier()

    # ---------------------------------------------------------------- training loop
    bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps, disable=not master, dynamic_ncols=True)
    last_eval = history.get("eval_last", history.get("eval_initial", {})).get("accuracy", float("nan"))
    for step in bar:
        t = {}
        t_step = t0 = time.time()

        # 1. Rollout: this rank's share of the step's prompts, G samples each.
        idx = prompt_order(len(train_problems), data_pos, n_prompts, cfg.seed)[rank::world]
        data_pos += n_prompts
        fresh, texts = generate(
            gen_model, tokenizer, [prompts_all[i] for i in idx], G, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, batch_size=cfg.rollout.gen_batch_size,
            prompt_idx=idx, step=step,
        )
        new_tokens = int(fresh.completion_len.sum())
        if distributed:
            new_tokens = int(all_reduce(torch.tensor(float(new_tokens))))
        generated_tokens += new_tokens
        t["generate"] = time.time() - t0

        # 2. Reward: verify each completion against its gold answer.
        t0 = time.time()
        rewards, correct, reward_metrics = score_batch(texts, [train_problems[i].answer for i in idx for _ in range(G)], cfg.reward)
        fresh.reward = torch.tensor(rewards, dtype=torch.float32)
        fresh.correct = torch.tensor(correct, dtype=torch.bool)
        t["reward"] = time.time() - t0

        # 3. Advantages within each group (RLEP first appends stored successes of the same prompt to each group).
        t0 = time.time()
        fresh = replay.before_advantages(fresh, step)
        fresh.advantage, adv_metrics = grpo.group_advantages(fresh.reward, fresh.group, cfg.grpo.adv_scale, cfg.grpo.adv_eps)
        t["advantage"] = time.time() - t0

        # 4. Replay: add stored rollouts to this update (strategy from config; `none` adds nothing).
        t0 = time.time()
        replayed = replay.sample(fresh, step)
        batch = fresh if replayed is None else Rollouts.cat([fresh, replayed], tokenizer.pad_token_id)
        t["replay_sample"] = time.time() - t0

        # 5. Update: mini-batches (optimizer steps) × micro-batches (gradient accumulation); see update_policy.
        step_metrics, batch.entropy, reasons, times = update_policy(
            cfg, fwd_model, optimizer, scheduler, batch, device=device, autocast=autocast, ref_model=ref_model
        )
        for reason in filter(None, reasons):
            skipped[reason] += 1
        t.update(times)

        # 6. Replay push: the fresh rows (with rewards, advantages, behaviour log-probs and entropy) go in.
        t0 = time.time()
        replay.push(batch.select(~batch.replayed), step)
        t["replay_push"] = time.time() - t0

        # 7. Log: one line per step; loss metrics combined over micro-batches (and ranks), averaged over mini-batches.
        is_fresh = ~batch.replayed
        batch_stats = {
            "reward_mean": float(batch.reward[is_fresh].mean()),
            "correct_mean": float(batch.correct[is_fresh].float().mean()),
            "response_len": float(batch.completion_len[is_fresh].float().mean()),
            "truncated_frac": float(batch.truncated[is_fresh].float().mean()),
            **adv_metrics,
            **reward_metrics,
            **replay.metrics(),
            "replay/rows": int(batch.replayed.sum()),
            "replay/token_share": float(batch.completion_len[batch.replayed].sum() / batch.completion_len.sum().clamp(min=1)),
        }
        if distributed:
            batch_stats = over_ranks(batch_stats, world)
        t["other"] = time.time() - t_step - sum(t.values())  # bookkeeping between the phases
        row = {
            "step": step + 1,
            "generated_tokens": generated_tokens,
            **batch_stats,
            **{k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]},
            "skipped/zero_adv": skipped["zero_adv"],
            "skipped/nonfinite": skipped["nonfinite"],
            "lr": scheduler.get_last_lr()[0],
            **{f"time/{k}": v for k, v in t.items()},
            "time/step": time.time() - t_step,
        }

        # 8. Eval every N steps and at the end.
        if (cfg.eval.every and (step + 1) % cfg.eval.every == 0) or step + 1 == cfg.max_steps:
            if master:
                t0 = time.time()
                ev = run_eval()
                history["eval_last"] = ev
                last_eval = ev["accuracy"]
                row.update({f"eval/{k}": v for k, v in ev.items()})
                row["time/eval"] = time.time() - t0
            if distributed:
                dist.barrier()
        row["wall_seconds"] = time.time() - t_start + wall_offset  # a resumed run continues its clock
        if master:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            if run:
                run.log(row, step=step + 1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", eval=f"{last_eval:.3f}")

        # 9. Checkpoint: everything needed to continue this exact run (under torchrun, every rank's buffer and RNG too).
        if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0 and step + 1 < cfg.max_steps:
            ranks = [None] * world if master and distributed else None
            if distributed:
                dist.gather_object({"replay": replay.state_dict(), "rng": rng_state()}, ranks, dst=0)
            if master:
                history["wall_before"] = row["wall_seconds"]
                state = {"step": step + 1, "data_position": data_pos, "generated_tokens": generated_tokens, "skipped": skipped,
                         "wandb_id": wandb_id, "history": history, "config": to_dict(cfg), "ranks": ranks}
                save_checkpoint(out, step + 1, model, tokenizer, optimizer, scheduler, replay, state, cfg.checkpoint.keep_last)

    # ---------------------------------------------------------------- finish
    summary = {}
    if master:
        model.save_pretrained(out / "final")
        tokenizer.save_pretrained(out / "final")
        last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1]) if cfg.max_steps else {}
        ev0, ev1 = history.get("eval_initial", {}), history.get("eval_last", history.get("eval_initial", {}))
        summary = {
            "strategy": cfg.replay.strategy,
            "seed": cfg.seed,
            "steps": cfg.max_steps,
            "eval_accuracy_initial": ev0.get("accuracy"),
            "eval_accuracy_final": ev1.get("accuracy"),
            "eval_response_len_final": ev1.get("response_len"),
            "generated_tokens": generated_tokens,
            "wall_seconds": last.get("wall_seconds", time.time() - t_start),
            "entropy_final": last.get("entropy"),
            "skipped_updates": skipped,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        metrics_file.close()
        if run:
            run.summary.update(summary)
            run.finish()
    if distributed:
        dist.destroy_process_group()
    return summary


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def over_ranks(stats: dict, world: int) -> dict:
    """Batch statistics of every rank's shard combined: counts (replay/rows, adv/groups) add up, the rest are means
    over ranks (exact for the fresh-row means: every rank holds as many fresh rows). replay/* describe the mean buffer."""
    per_rank = [None] * world
    dist.all_gather_object(per_rank, stats)
    keys = [k for k in stats if all(k in s for s in per_rank)]
    return {k: (sum if k in ("replay/rows", "adv/groups") else np.mean)([s[k] for s in per_rank]) for k in keys}


def rlep_solutions(cfg: Config, tokenizer, problems, prompts_all) -> Rollouts:
    """RLEP phase I from a JSONL of verified solutions: {"prompt_idx": i | "problem": text, "completion": text}."""
    by_problem = {p.problem: i for i, p in enumerate(problems)}
    idx, completions = [], []
    for lineno, r in enumerate(read_jsonl(cfg.replay.rlep_source), 1):
        i = r.get("prompt_idx", by_problem.get(r.get("problem")))
        if not isinstance(i, int) or not 0 <= i < len(problems) or not isinstance(r.get("completion"), str):
            raise RunError(f"{cfg.replay.rlep_source}: row {lineno} needs a known prompt_idx or problem, and a completion")
        idx.append(i)
        completions.append(r["completion"])
    if not idx:
        raise RunError(f"replay.rlep_source {cfg.replay.rlep_source} holds no solutions")
    ro = rollouts_from_texts(tokenizer, [prompts_all[i] for i in idx], completions, idx, cfg.rollout.max_new_tokens)
    ro.reward = torch.full((len(idx),), cfg.reward.correct)
    ro.correct = torch.ones(len(idx), dtype=torch.bool)
    return ro


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
