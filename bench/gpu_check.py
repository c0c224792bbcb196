"""Check the GPU path before spending GPU-days on a paper config (≤ 10 minutes on one H100): a
Qwen2.5-0.5B-shaped random model at the real vocabulary (151,936), the paper settings (bf16 compute,
float32 master weights, gradient checkpointing, FSDP2).

Usage:
  python bench/gpu_check.py                                  # random-init Qwen2.5-0.5B shape
  python bench/gpu_check.py --shape Qwen/Qwen3-4B-Base       # a shape of bench/memory_plan.SHAPES
  python bench/gpu_check.py --model.path /models/Qwen2.5-Math-7B --peak-tflops 989

(a) The real distributed path: `torchrun --nproc_per_node=1 train.py` (NCCL, FSDP at world size 1),
    two steps of a replay strategy with a checkpoint after each, `--resume` for a third, and a
    `from_pretrained` of final/.
(b) Generation on real-length prompts: useful (completion) and padded (batch × steps) tokens/s; no
    all-gather inside `generate` (the weights were gathered once before it); a bf16 KV cache.
(c) The behaviour-vs-trainer log-prob gap of fresh tokens at the sampling weights (mean, p99, the
    fraction of tokens whose ratio falls outside the clip range): fails above --max-gap-mean.
(d) Peak memory of each phase against bench/memory_plan.py: fails more than 10 % off the plan,
    above or below (a GPU only).
(e) One lr 1e-6 AdamW step moves ≥ 99 % of the weights with a non-zero gradient, and the gradient
    norm equals that of float32 weights without FSDP (bf16 autocast) within 1 %; the cold and a warm
    step's tokens/s and MFU. With --extras: the TF32 head and a 4x larger micro-batch beside them.
Prints each figure the moment it is measured (the float32 reference, the slowest, last), then
`gpu_check: OK` or `gpu_check: FAILED (...)`; exits 0 / 1. Without a GPU it prints one line and
exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from bench import cli
from support.parallel import local

PEAK_TFLOPS = {"H100": 989, "H200": 989, "B200": 2250, "A100": 312, "L40S": 362, "A10": 125,
               "L4": 121, "4090": 165}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--model.path", dest="path", help="a local model folder (default: random)")
    ap.add_argument("--shape", default="Qwen/Qwen2.5-0.5B",
                    help="a key of bench/memory_plan.SHAPES")
    ap.add_argument("--vocab", type=cli.count, default=0,
                    help="the random model's (0: the shape's)")
    ap.add_argument("--prompts", type=cli.positive_int, default=8)
    ap.add_argument("--group-size", type=cli.positive_int, default=8)
    ap.add_argument("--prompt-tokens", type=cli.positive_int, default=512,
                    help="length of the random prompts")
    ap.add_argument("--max-new-tokens", type=cli.positive_int, default=1024)
    ap.add_argument("--peak-tflops", type=cli.positive_float,
                    help="the GPU's dense bf16 peak (default: by its name)")
    ap.add_argument("--max-gap-mean", type=float, default=0.02,
                    help="largest mean |behaviour − trainer| log-prob of fresh tokens")
    ap.add_argument("--max-grad-norm-diff", type=float, default=0.01,
                    help="largest relative difference of the gradient norm from the reference's")
    ap.add_argument("--lora", type=cli.count, default=0,
                    help="adapters of this rank on a frozen bf16 base "
                         "(one process, no FSDP; (e) then checks no reference gradient norm)")
    ap.add_argument("--json", help="also write every figure measured to this JSON file")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    ap.add_argument("--skip-torchrun", action="store_true", help="leave out check (a)")
    ap.add_argument("--extras", action="store_true",
                    help="also a warm update with the TF32 head and one with a 4x micro-batch")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more warm update: its top ops and the output layer's share")
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # the CPU tests
    a = ap.parse_args(argv)
    ap.check_file("--json", a.json, a.overwrite)
    if a.path and not (Path(a.path) / "config.json").is_file():
        ap.error(f"--model.path {a.path}: not a model folder (no config.json)")
    from memory_plan import SHAPES

    if not a.path and a.shape not in (*SHAPES, "dry"):
        ap.error(f"--shape {a.shape!r}: not a shape of bench/memory_plan.SHAPES "
                 f"({', '.join(SHAPES)}) or dry")
    if a.vocab:  # (0: the shape's own)
        fault = cli.tokenizer_fault(a.vocab)
        if fault:
            ap.error(f"--vocab {a.vocab} {fault}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if not torch.cuda.is_available() and not a.allow_cpu:
        print("gpu_check: no GPU is visible (torch.cuda.is_available() is False); "
              "run it on the GPU machine")
        return 2
    shape = shape_of(a.shape) if not a.path else None
    if shape is not None and a.vocab:
        shape = dataclasses.replace(shape, vocab=a.vocab)
    name = f"{a.shape.replace('/', '_')}_{shape.vocab}" if shape else "model"
    work = Path("/tmp") / f"gpu_check_{name}"
    path = a.path or make_random_model(shape, work / "model")
    REPORT.update(shape=a.shape if shape else path, lora_rank=a.lora, prompts=a.prompts,
                  group_size=a.group_size, prompt_tokens=a.prompt_tokens,
                  max_new_tokens=a.max_new_tokens)
    failures = []
    try:
        if not a.skip_torchrun:
            failures += distributed_check(path, work, a)
        failures += in_process_checks(path, shape, a)
    finally:
        REPORT["failures"] = failures
        if a.json:
            Path(a.json).write_text(json.dumps(finite(REPORT), indent=1) + "\n")
    print("gpu_check: OK" if not failures else f"gpu_check: FAILED ({'; '.join(failures)})")
    return 1 if failures else 0


REPORT: dict = {}
"""Every figure the checks measure, by check: what --json writes."""


def finite(x):
    """`x` with NaN and infinite floats as None, so the JSON is strict."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def shape_of(name: str):
    """A shape of bench/memory_plan.SHAPES by its model id, or `dry`: a toy one (0.1 M parameters)
    for bench/gpu_run.py --dry-run on a CPU."""
    from memory_plan import SHAPES, Shape

    if name == "dry":
        return Shape(64, 2, 4, 2, 16, 128, 512, True, True)
    return SHAPES[name]


BASE = str(REPO / "configs" / "papers" / "gpu_base.yaml")


def run_args(path: str, a: argparse.Namespace) -> list[str]:
    """Overrides of configs/papers/gpu_base.yaml for every check: FSDP, this model, few rows."""
    n = a.prompts * a.group_size
    lora = [f"--model.lora.rank={a.lora}", "--model.parallel=ddp"] if a.lora else []
    return [f"--model.path={path}", "--model.parallel=fsdp", *lora, "--optim.lr=1e-6",
            f"--rollout.max_new_tokens={a.max_new_tokens}", f"--rollout.group_size={a.group_size}",
            f"--rollout.batch_size={n}", f"--rollout.gen_batch_size={n}",
            f"--data.max_prompt_tokens={a.prompt_tokens}"]


def distributed_check(path: str, work: Path, a: argparse.Namespace) -> list[str]:
    """(a): train.py under torchrun (one process: NCCL, or gloo on a CPU), two steps of uniform
    replay with a checkpoint each, --resume for a third, then final/ through from_pretrained."""
    from transformers import AutoModelForCausalLM

    work.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="run_", dir=work))  # its own: two checks never share one
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(REPO / "train.py"), "--config", BASE, *run_args(path, a), f"--out_dir={out}",
           "--data.train=tiny", "--data.eval=tiny", "--data.data_dir=", "--eval.n=4", "--eval.k=1",
           "--eval.every=0", "--checkpoint.every=1", "--replay.strategy=uniform",
           "--replay.ratio=0.25",
           "--wandb.mode=disabled", "--data.max_prompt_tokens=0", "--optim.warmup_steps=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    t0, failures = time.time(), []
    for steps, extra in ((2, ["--overwrite"]), (3, ["--resume"])):
        r = subprocess.run([*cmd, f"--max_steps={steps}", *extra], cwd=REPO, env=env,
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            tail = said(r.stderr)
            print(f"(a) torchrun train.py --max_steps={steps} {' '.join(extra)}: exit "
                  f"{r.returncode}: {tail}")
            return [f"(a) train.py under torchrun exited {r.returncode}"]
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    if len(lines) != 3 or "rollout/logp_gap_mean" not in lines[-1]:
        failures.append("(a) metrics.jsonl lacks steps or the log-prob gap")
    REPORT["torchrun"] = {"metric_lines": len(lines), "checkpoints": checkpoints,
                          "seconds": time.time() - t0,
                          "final_dtype": str(next(model.parameters()).dtype)}
    print(f"(a) torchrun, FSDP at world size 1: 2 steps, resumed to 3 ({len(lines)} metric lines), "
          f"checkpoints {checkpoints}, final/ loads ({type(model).__name__}, "
          f"{next(model.parameters()).dtype}) in {time.time() - t0:.0f} s")
    if not failures:  # (a failed run stays for a look; a passed one is a checkpoint's GBs)
        shutil.rmtree(out, ignore_errors=True)
    return failures


def said(stderr: str) -> str:
    """What a failed train.py said: its last line naming an error, not torchrun's summary."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip().strip("=-")]
    errors = [ln for ln in lines if "error" in ln.lower() and "ChildFailedError" not in ln]
    found = errors or lines or [""]
    return found[-1][:300]


def in_process_checks(path: str, shape, a: argparse.Namespace) -> list[str]:
    """(b)-(e) in this process, FSDP at world size 1 over a one-process group."""
    from config import load_config
    from support.models import load_policy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with cli.one_process(device):
        cfg = load_config(BASE, run_args(path, a))
        model, policy, tok, _, compute = load_policy(cfg, path, device, 1)
        peaks = {}
        batch, failures = generation_check(model, tok, cfg, compute, a, peaks)
        failures += update_checks(cfg, model, policy, compute, device, batch, path, a, peaks,
                                  shape)
        failures += chunked_head_check(model, compute, device, batch, a)
    return failures


def generation_check(model, tok, cfg, compute, a, peaks: dict):
    """(b): one generation phase; returns (rollouts, failures), the phase's peak in `peaks`."""
    from rollout import generate
    from support.parallel import generation, hf_module

    g = torch.Generator().manual_seed(0)
    n_vocab = min(len(tok), model.config.vocab_size)
    prompts = []
    for _ in range(a.prompts):
        prompts.append(torch.randint(3, n_vocab, (a.prompt_tokens,), generator=g).tolist())
    stop = sorted({tok.eos_token_id, tok.pad_token_id} - {None})
    caches, gathers = [], []

    def keep_cache(module, args, kwargs):
        caches.append(kwargs.get("cache", kwargs.get("past_key_values")))  # (5.24 renamed it)

    hook = hf_module(model).register_forward_pre_hook(keep_cache, with_kwargs=True)
    reset_peak()
    torch.manual_seed(0)  # the samples too are seeded: a rerun checks the same batch
    with generation(model, compute):
        cli.sync()
        t0 = time.time()
        with counting_all_gathers(gathers):
            ro, _ = generate(model, tok, prompts, cfg.rollout, stop)
        cli.sync()
        seconds = time.time() - t0
    peaks["generation"] = peak_bytes()
    hook.remove()
    kv = caches[-1].layers[0].keys.dtype if caches and caches[-1] is not None else None
    useful, padded = int(ro.completion_len.sum()), len(ro) * int(ro.completion_len.max())
    REPORT["generation"] = {"useful_tokens_per_s": useful / seconds,
                            "padded_tokens_per_s": padded / seconds, "rows": len(ro),
                            "useful_tokens": useful, "seconds": seconds,
                            "all_gathers_inside_generate": len(gathers), "kv_cache": str(kv),
                            "cache": type(caches[-1]).__name__}
    print(f"(b) generation: {useful / seconds:.0f} useful tokens/s, {padded / seconds:.0f} padded "
          f"tokens/s ({len(ro)} rows, prompts of {a.prompt_tokens}); all-gathers inside generate: "
          f"{len(gathers)}; KV cache {kv}")
    failures = [f"(b) {len(gathers)} all-gathers inside generate"] * bool(gathers)
    if kv != torch.bfloat16:
        failures.append(f"(b) the KV cache holds {kv}, not bfloat16")
    return ro, failures


@contextlib.contextmanager
def counting_all_gathers(counter: list):
    """Count FSDP2's all-gathers while inside: dist.all_gather_single (torch 2.13) or
    all_gather_into_tensor (before), looked up at each call."""
    import torch.distributed as dist

    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def counted(*args, **kwargs):
            counter.append(name)
            return real[name](*args, **kwargs)
        return counted

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield
    finally:
        for name in names:
            setattr(dist, name, real[name])


def gap_stats(logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, cfg) -> dict:
    """(c): |behaviour − trainer| log-probs over `mask` (B, L): mean, p99, max, and the fraction of
    tokens whose ratio exp(trainer − behaviour) lies outside [1 − eps_low, 1 + eps_high]."""
    d = (logp - behav)[mask].double()  # (n,)
    ratio = d.exp()
    outside = (ratio < 1 - cfg.grpo.eps_low) | (ratio > 1 + cfg.grpo.eps_high)
    return {"mean": d.abs().mean().item(), "p99": d.abs().quantile(0.99).item(),
            "max": d.abs().max().item(), "outside_clip": outside.double().mean().item()}


def update_checks(cfg, model, policy, compute, device, batch, path, a, peaks: dict,
                  shape) -> list[str]:
    """(c), (d) and (e), each line printed as its figure is measured: the gap of the no-grad pass,
    one AdamW step at lr 1e-6 (cold) with the gap of its training forward, the peak memory of each
    phase against the plan (a GPU), a warm step, the extras, and last the gradient norm against a
    float32 model without FSDP or autocast."""
    from config import update_settings
    from grpo import no_grad_logprobs
    from support.parallel import resharded

    batch.advantage = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    lp, _ = no_grad_logprobs(model, batch, update_settings(cfg), compute, device)
    stats = gap_stats(lp, batch.behav_logp, batch.completion_mask(), cfg)
    REPORT["gap"] = {f"no_grad_{k}": v for k, v in stats.items()}
    print(f"(c) |behaviour − trainer| log-prob of fresh tokens, no-grad pass: mean "
          f"{stats['mean']:.4f}, p99 {stats['p99']:.4f}, outside the clip range "
          f"{100 * stats['outside_clip']:.3f} %", flush=True)
    # the float32 shards, as train.py's optimizer holds them: not the root's gathered bf16 copies,
    # which FSDP2 keeps after a forward (the no-grad pass above)
    params = list(resharded(model).parameters())
    before = [local(p.detach()).to("cpu", copy=True) for p in params]  # not in the GPU's peak
    optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
    live = {}

    def record(*_):  # which weights received a non-zero gradient
        for i, p in enumerate(params):
            if p.grad is not None:
                live[i] = (local(p.grad) != 0).cpu()

    optimizer.register_step_pre_hook(record)
    reset_peak()
    metrics, tps = timed_update(cfg, model, policy, optimizer, batch, device, compute)  # cold
    peaks["training"] = peak_bytes()
    hit = sum(int(((local(params[i].detach()).cpu() != before[i]) & m).sum())
              for i, m in live.items())
    moved = hit / max(1, sum(int(m.sum()) for m in live.values()))
    gap = metrics["rollout/logp_gap_mean"]
    REPORT["gap"] |= {"training_forward_mean": gap,
                      "training_forward_max": metrics["rollout/logp_gap_max"]}
    print(f"(c) the same, training forward: mean {gap:.4f} (bound {a.max_gap_mean}), max "
          f"{metrics['rollout/logp_gap_max']:.4f}", flush=True)
    print(f"(e) training, the cold step: {tps:.0f} tokens/s{mfu(model, tps, a)}; one AdamW step at "
          f"lr 1e-6 moved {100 * moved:.2f} % of the weights with a non-zero gradient (need "
          f"≥ 99 %)", flush=True)
    failures = [f"(c) mean gap {gap:.4f} > {a.max_gap_mean}"] * (not gap <= a.max_gap_mean)
    failures += [f"(e) moved {100 * moved:.2f} % < 99 %"] * (moved < 0.99)
    if shape is not None and device.type == "cuda":
        failures += memory_check(cfg, shape, peaks, a)
    # a second update on the same batch (lr 1e-6 again): warm, with the allocator's blocks, the
    # optimizer's state and any compiled kernels already in place
    _, warm = timed_update(cfg, model, policy, optimizer, batch, device, compute)
    trained = sum(p.numel() for p in params if p.requires_grad)
    REPORT["update"] = {"tokens": int(batch.seq_len.sum()), "tokens_per_s": tps,
                        "params": sum(p.numel() for p in params), "trained_params": trained,
                        "moved_frac": moved, "grad_norm": metrics["grad_norm"],
                        **mfu_figures(model, tps, a), "warm_tokens_per_s": warm,
                        "warm": mfu_figures(model, warm, a)}
    print(f"(e) training, a warm step: {warm:.0f} tokens/s{mfu(model, warm, a)}", flush=True)
    if a.extras:
        REPORT["head_tf32"] = tf32_update(cfg, model, policy, optimizer, batch, device, compute, a)
        REPORT["larger_micro_batch"] = larger_micro_batch_update(cfg, model, policy, optimizer,
                                                                 batch, device, compute, a)
    if a.profile:
        REPORT["profile"] = profiled_update(cfg, model, policy, optimizer, batch, device, compute)
    optimizer.state.clear()  # the reference's float32 copy fits beside the model on an 80 GB card
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    ref_norm = math.nan if a.lora else reference_grad_norm(cfg, path, batch, device)
    rel = abs(metrics["grad_norm"] / ref_norm - 1)
    REPORT["update"]["reference_grad_norm"] = ref_norm
    print(f"(e) grad norm {metrics['grad_norm']:.5g} vs the float32 reference's {ref_norm:.5g} "
          f"({100 * rel:.2f} %, need ≤ {100 * a.max_grad_norm_diff:g} %)", flush=True)
    off = rel > a.max_grad_norm_diff  # (NaN under LoRA: no reference)
    return failures + [f"(e) grad norm {100 * rel:.2f} % off the reference"] * off


def chunked_head_check(model, compute, device, batch, a, rows: int = 4) -> list[str]:
    """(f): the chunked head's completion log-probs (support/logprobs.py) against the whole-logits
    path (float32 (rows, L, V) logits, then log-softmax) on the first `rows` rows, each with its
    backward: the largest |difference|, and each path's peak memory and time."""
    import torch.nn.functional as F

    from support.logprobs import completion_logprobs

    tokens = batch.tokens[:rows].to(device)  # (b, L)
    prompt_len, seq_len = batch.prompt_len[:rows].to(device), batch.seq_len[:rows].to(device)
    ar = torch.arange(tokens.shape[1], device=device)
    mask = (ar[None] >= prompt_len[:, None]) & (ar[None] < seq_len[:, None])  # (b, L) completions
    attention = (ar[None] < seq_len[:, None]).long()
    found = {}
    for path in ("chunked", "whole"):
        model.zero_grad(set_to_none=True)
        reset_peak()
        cli.sync()
        t0 = time.time()
        with compute:
            if path == "chunked":
                logp = completion_logprobs(model, tokens, prompt_len, seq_len, 1.0,
                                           share_prompt=False)[0]
            else:
                logits = model(input_ids=tokens, attention_mask=attention).logits  # (b, L, V)
                picked = logits[:, :-1].float().log_softmax(-1).gather(2, tokens[:, 1:, None])
                logp = F.pad(picked[..., 0], (1, 0))  # (b, L): position t−1 predicts token t
                del logits
        logp[mask].sum().backward()
        cli.sync()
        found[path] = (logp.detach()[mask], time.time() - t0, peak_bytes())
    model.zero_grad(set_to_none=True)
    diff = (found["chunked"][0] - found["whole"][0]).abs().max().item()
    REPORT["chunked_head"] = {"rows": len(tokens), "tokens": int(seq_len.sum()),
                              "max_abs_diff": diff}
    for path, (_, seconds, peak) in found.items():
        REPORT["chunked_head"][path] = {"seconds": seconds, "peak_gb": peak / 1e9}
    print(f"(f) chunked head vs whole logits, {len(tokens)} rows with backward: max |Δ log-prob| "
          f"{diff:.2e}; peak {found['chunked'][2] / 1e9:.2f} vs {found['whole'][2] / 1e9:.2f} GB; "
          f"{found['chunked'][1]:.2f} vs {found['whole'][1]:.2f} s")
    if not diff <= 1e-3:
        return [f"(f) the chunked head differs from whole logits by {diff:.2e}"]
    return []


def reference_grad_norm(cfg, path: str, batch, device) -> float:
    """The same update's gradient norm from float32 weights without FSDP (bf16 compute by autocast,
    as one GPU without FSDP runs it), not clipped."""
    import grpo
    from config import update_settings
    from support.models import checkpoint_activations, load_pretrained

    model = load_pretrained(path, dtype=torch.float32)[0].to(device)
    if cfg.model.gradient_checkpointing:  # as the run's model: the same gradient, less memory
        checkpoint_activations(model)
    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.model.parallel, ref_cfg.optim.grad_clip = "ddp", 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    bf16 = cfg.model.compute_dtype == "bfloat16"
    compute = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else None
    metrics, _, _, _ = grpo.update_policy(update_settings(ref_cfg), model, model, optimizer, batch,
                                          device, compute)
    del model
    return metrics["grad_norm"]


def memory_check(cfg, shape, peaks: dict, a) -> list[str]:
    """(d): each phase's peak against bench/memory_plan.estimate at this batch and these lengths."""
    from memory_plan import estimate

    o = cfg.optim
    e = estimate(shape, gpus=1, fsdp=not a.lora, micro_batch=o.micro_batch_size,
                 micro_tokens=o.micro_batch_tokens, gen_batch=a.prompts * a.group_size,
                 prompt=a.prompt_tokens, response=a.max_new_tokens,
                 logprob_batch=o.logprob_batch_size, lora_rank=a.lora,
                 checkpointing=cfg.model.gradient_checkpointing)
    # the first step, as measured: no AdamW state before its optimizer step, no gradients while
    # generating (bench/memory_plan.py's first_step_peak, phase by phase)
    w, g = e["weights"], e["gradients"]
    step = g + e["optimizer"] + e["optimizer_step"]
    training = w + max(g + e["activations"] + e["logits"], step, e["logprob_pass"])
    plan = {"generation": w + e["generation"], "training": training}
    failures = []
    REPORT["memory"] = {"plan_parts_gb": {k: v / 1e9 for k, v in e.items()}}
    for phase, want in plan.items():
        ratio = peaks[phase] / want - 1
        REPORT["memory"][phase] = {"measured_gb": peaks[phase] / 1e9, "plan_gb": want / 1e9,
                                   "ratio": ratio}
        print(f"(d) peak memory, {phase}: {peaks[phase] / 1e9:.2f} GB, memory_plan "
              f"{want / 1e9:.2f} GB ({100 * ratio:+.1f} %)", flush=True)
        if abs(ratio) > 0.10:  # below too: a plan that far above what is used misleads as well
            failures.append(f"(d) {phase} memory {100 * ratio:+.1f} % off the plan")
    return failures


def timed_update(cfg, model, policy, optimizer, batch, device, compute) -> tuple[dict, float]:
    """grpo.update_policy on `batch`: its metrics, and the tokens of the batch per second it
    took."""
    import grpo
    from config import update_settings

    cli.sync()
    t0 = time.time()
    metrics, _, _, _ = grpo.update_policy(update_settings(cfg), model, policy, optimizer, batch,
                                          device, compute)
    cli.sync()
    return metrics, int(batch.seq_len.sum()) / (time.time() - t0)


def tf32_update(cfg, model, policy, optimizer, batch, device, compute, a) -> dict:
    """model.head_tf32 (the output layer's GEMMs on TF32 tensor cores) against the float32 head
    on the same batch and weights: the no-grad log-probs' largest difference, then a warm update
    of each at lr 0 (the same weights for both), their tokens/s, MFU and gradient norms, after
    one float32 update more whose gradient norm against the next float32 one is the floor of
    repeated updates."""
    from config import update_settings
    from grpo import no_grad_logprobs
    from support.logprobs import head_precision

    s, mask = update_settings(cfg), batch.completion_mask()
    r = {}
    try:
        for name in ("float32_first", "float32", "tf32"):  # the first: float32's repeat, the floor
            head_precision(model, tf32=name == "tf32")
            lp = no_grad_logprobs(model, batch, s, compute, device)[0]
            with zero_lr(optimizer):
                metrics, tps = timed_update(cfg, model, policy, optimizer, batch, device, compute)
            r[name] = {"warm_tokens_per_s": tps, "warm": mfu_figures(model, tps, a),
                       "grad_norm": metrics["grad_norm"], "logp": lp}
    finally:
        head_precision(model, tf32=False)
    first = r.pop("float32_first")
    diff = r["tf32"].pop("logp") - r["float32"].pop("logp")
    r["logprob_max_abs_diff"] = float(diff[mask].abs().max())
    rel = abs(r["tf32"]["grad_norm"] / r["float32"]["grad_norm"] - 1)
    r["grad_norm_rel_diff"] = rel
    r["float32_repeat_grad_norm_rel_diff"] = abs(first["grad_norm"] / r["float32"]["grad_norm"] - 1)
    tps = r["tf32"]["warm_tokens_per_s"]
    print(f"(e) with model.head_tf32, a warm step: {tps:.0f} tokens/s{mfu(model, tps, a)} (float32 "
          f"head: {r['float32']['warm_tokens_per_s']:.0f}); grad norm {100 * rel:.3f} % and "
          f"log-probs within {r['logprob_max_abs_diff']:.2e} of the float32 head's (float32 "
          f"repeated: {100 * r['float32_repeat_grad_norm_rel_diff']:.3f} %)")
    return r


@contextlib.contextmanager
def zero_lr(optimizer):
    """The learning rates at 0 while inside: updates that leave the weights as they were."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr


def larger_micro_batch_update(cfg, model, policy, optimizer, batch, device, compute, a,
                              times: int = 4) -> dict:
    """A warm update (lr 0) with optim.micro_batch_tokens × `times`: fewer, larger passes; its
    tokens/s, MFU and peak memory."""
    big = copy.deepcopy(cfg)
    big.optim.micro_batch_tokens *= times
    reset_peak()
    with zero_lr(optimizer):
        _, tps = timed_update(big, model, policy, optimizer, batch, device, compute)
    r = {"micro_batch_tokens": big.optim.micro_batch_tokens, "warm_tokens_per_s": tps,
         "warm": mfu_figures(model, tps, a), "peak_gb": peak_bytes() / 1e9}
    print(f"(e) with micro_batch_tokens {r['micro_batch_tokens']}, a warm step: {tps:.0f} "
          f"tokens/s{mfu(model, tps, a)}; peak {r['peak_gb']:.2f} GB")
    return r


def profiled_update(cfg, model, policy, optimizer, batch, device, compute, top: int = 20):
    """Where a warm update's time goes: one more update on the batch under torch.profiler. On a
    GPU its kernels by device time, on a CPU its ops by self time on the host; each with its share
    of the total, and the time inside the chunked output layer's forward and backward
    (support/logprobs.py labels them)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU]
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        timed_update(cfg, model, policy, optimizer, batch, device, compute)
    events = prof.key_averages()
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    timed = [e for e in events if e.device_type == kind]  # kernels, or the host's ops
    total = sum(getattr(e, attr) for e in timed)
    ops = sorted(timed, key=lambda e: getattr(e, attr), reverse=True)[:top]
    head = {}
    for e in events:
        if e.key.startswith("chunked_head") and e.device_type == DeviceType.CPU:
            head[e.key] = (e.device_time_total if cuda else e.cpu_time_total) / 1e3
    r = {"clock": "device" if cuda else "host", "total_ms": total / 1e3, "chunked_head_ms": head,
         "top": [{"op": e.key, "ms": getattr(e, attr) / 1e3, "share": getattr(e, attr) / total,
                  "calls": e.count} for e in ops]}
    lines = [f"{o['share']:6.1%} {o['ms']:9.1f} ms  {o['op'][:80]}" for o in r["top"][:8]]
    said = ", ".join(f"{k} {v:.0f} ms" for k, v in head.items())
    print(f"(e) profile of a warm update ({r['clock']} time {r['total_ms']:.0f} ms; {said}):\n    "
          + "\n    ".join(lines))
    return r


def mfu_figures(model, tps: float, a) -> dict:
    """The update's model FLOP utilisation, 6 × parameters × trained tokens/s (recomputed
    activations not counted as work), against the datasheet's dense bf16 peak by the GPU's name
    and against the measured one when given (--peak-tflops: gpu_run's bf16 matmul)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    datasheet = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    work = 6 * sum(p.numel() for p in model.parameters()) * tps
    r = {"device": name}
    if datasheet:
        r |= {"datasheet_peak_tflops": datasheet, "mfu_datasheet": work / (datasheet * 1e12)}
    if a.peak_tflops:
        r |= {"measured_peak_tflops": a.peak_tflops, "mfu_measured": work / (a.peak_tflops * 1e12)}
    if len(r) > 1:  # the earlier runs' field: the measured peak's when there is one
        r["mfu"] = r.get("mfu_measured", r.get("mfu_datasheet"))
    return r


def mfu(model, tps: float, a) -> str:
    r = mfu_figures(model, tps, a)
    said = []
    if "mfu_datasheet" in r:
        said.append(f"{100 * r['mfu_datasheet']:.1f} % of the datasheet's "
                    f"{r['datasheet_peak_tflops']:g} TFLOP/s")
    if "mfu_measured" in r:
        said.append(f"{100 * r['mfu_measured']:.1f} % of the measured "
                    f"{r['measured_peak_tflops']:g} TFLOP/s")
    if not said:
        return ""
    return f", MFU {' and '.join(said)} on {r['device']}"


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_bytes() -> float:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else math.nan


def make_random_model(shape, folder: Path) -> str:
    """A random-init model of `shape` (its real vocabulary; Qwen3 where the shape has no q/k/v
    bias, else Qwen2) with the tiny tokenizer: ids past the tokenizer's 274 decode to nothing,
    which is all a shape check needs. Built in bf16 on the GPU when there is one (seconds, not
    minutes of CPU initialisation), saved as safetensors."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    from data.build_tiny_model import build_tokenizer

    if not (folder / "config.json").exists():
        tok = build_tokenizer()
        kind = Qwen2Config if shape.qkv_bias else Qwen3Config
        cfg = kind(vocab_size=shape.vocab, hidden_size=shape.hidden, head_dim=shape.head_dim,
                   num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                   num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate,
                   tie_word_embeddings=shape.tied, max_position_embeddings=32768,
                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        cuda = torch.cuda.is_available()
        dtype = torch.bfloat16 if cuda else torch.float32
        with torch.device("cuda" if cuda else "cpu"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        del model
    return str(folder)


if __name__ == "__main__":
    sys.exit(main())
