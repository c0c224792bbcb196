"""Check the GPU path before spending GPU-days on a paper config: a few steps of a realistic-shape model with the GPU
settings (bf16 compute, float32 master weights, gradient checkpointing), on one GPU.

Usage:
  python bench/gpu_check.py                                  # random-init Qwen2.5-0.5B shape, the tiny tokenizer
  python bench/gpu_check.py --shape Qwen/Qwen3-4B-Base       # another shape from bench/memory_plan.SHAPES
  python bench/gpu_check.py --model.path /models/Qwen2.5-Math-7B --peak-tflops 989

Prints generation tokens/s, training tokens/s and MFU (6·params·tokens / time / the GPU's bf16 peak), peak memory
against bench/memory_plan.py's estimate, the fraction of weights one lr 1e-6 AdamW step moved (of those with a
non-zero gradient), and the largest |behaviour − training| log-prob gap in bf16. Exits 1 when the step moved fewer
than 99 % of those weights or the gap is over --max-gap (bf16 rounds a log-prob near 10 by about 0.04; the sampler
and the training forward also differ by the KV cache's summation order). Without a GPU it prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PEAK_TFLOPS = {"H100": 989, "H200": 989, "B200": 2250, "A100": 312, "L40S": 362, "A10": 125, "L4": 121, "4090": 165}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model.path", dest="path", help="a local model folder (default: a random-init --shape)")
    ap.add_argument("--shape", default="Qwen/Qwen2.5-0.5B", help="a key of bench/memory_plan.SHAPES")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: by its name)")
    ap.add_argument("--max-gap", type=float, default=0.5, help="largest |behaviour - training| log-prob allowed")
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # the tests run the logic on a CPU
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() and not a.allow_cpu:
        print("gpu_check: no GPU is visible (torch.cuda.is_available() is False); run it on the GPU machine")
        return 2
    from memory_plan import SHAPES, estimate

    import grpo
    from config import load_config
    from rollout import end_ids, full_weights, generate, load_policy, prompt_ids

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES[a.shape] if not a.path else None
    path = a.path or make_random_model(shape, Path("/tmp") / f"gpu_check_{a.shape.replace('/', '_')}")
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "papers" / "gpu_base.yaml"),
                      [f"--model.path={path}", "--model.parallel=ddp", f"--rollout.max_new_tokens={a.max_new_tokens}",
                       f"--rollout.group_size={a.group_size}", f"--rollout.batch_size={a.prompts * a.group_size}",
                       f"--rollout.gen_batch_size={a.prompts * a.group_size}", "--optim.lr=1e-6"])
    model, policy, tok, _, compute = load_policy(cfg, path, device, 1)
    n_params = sum(p.numel() for p in model.parameters())
    prompts = [prompt_ids(tok, f"{i}+{i * 7}-{i * 3}", "{problem}", True) for i in range(a.prompts)]
    stop = [] if not a.path else end_ids(tok, model, True, [])  # a random model runs every row to max_new_tokens
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
    gen_tps, train_tps, moved, gap = [], [], None, 0.0
    for step in range(a.steps):
        sync(device)
        t0 = time.time()
        with full_weights(model, compute):
            ro, _ = generate(model, tok, prompts, cfg.rollout, stop, step=step)
        sync(device)
        gen_tps.append(int(ro.completion_len.sum()) / (time.time() - t0))
        ro.advantage = torch.randn(len(ro), generator=torch.Generator().manual_seed(step))
        with torch.no_grad(), compute:  # the training forward's log-probs of what was sampled, in bf16
            lp, _ = grpo.no_grad_logprobs(model, ro, cfg, compute, device)
        gap = max(gap, (lp - ro.behav_logp)[ro.completion_mask()].abs().max().item())
        params, live = list(model.parameters()), {}
        before = [p.detach().clone() for p in params] if step == 0 else None
        def record(*_, params=params, live=live):  # which weights received a gradient in this step
            live.update({i: p.grad != 0 for i, p in enumerate(params) if p.grad is not None})

        hook = optimizer.register_step_pre_hook(record)
        sync(device)
        t0 = time.time()
        grpo.update_policy(cfg, model, policy, optimizer, ro, device, compute)
        sync(device)
        train_tps.append(int(ro.seq_len.sum()) / (time.time() - t0))
        hook.remove()
        if before is not None:
            hit = sum(int(((params[i].detach() != before[i]) & m).sum()) for i, m in live.items())
            moved = hit / max(1, sum(int(m.sum()) for m in live.values()))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak_tflops = a.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    tps = sorted(train_tps)[len(train_tps) // 2]
    mfu = f"{100 * 6 * n_params * tps / (peak_tflops * 1e12):.1f} %" if peak_tflops else "n/a (pass --peak-tflops)"
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else float("nan")
    est = estimate(replace(shape, vocab=len(tok)), gpus=1, fsdp=False, micro_batch=cfg.optim.micro_batch_size,
                   gen_batch=len(prompts) * a.group_size, prompt=max(map(len, prompts)), response=a.max_new_tokens,
                   logprob_batch=cfg.optim.logprob_batch_size)["peak"] / 1e9 if shape else None
    print(f"device {name}; {n_params / 1e9:.3f} B parameters")
    print(f"generation {sorted(gen_tps)[len(gen_tps) // 2]:.0f} tokens/s; training {tps:.0f} tokens/s; MFU {mfu}")
    print(f"peak memory {peak:.1f} GB" + (f" (bench/memory_plan.py estimate {est:.1f} GB)" if est else ""))
    print(f"one AdamW step at lr 1e-6 moved {100 * moved:.2f} % of the weights with a non-zero gradient (need ≥ 99 %)")
    print(f"largest |behaviour - training| log-prob in bf16: {gap:.3f} (bound {a.max_gap})")
    engines(path, prompts, a, device)
    ok = moved >= 0.99 and gap <= a.max_gap
    print("gpu_check: OK" if ok else "gpu_check: FAILED")
    return 0 if ok else 1


def engines(path: str, prompts: list, a, device: torch.device) -> None:
    """With vLLM installed: generation tokens/s of HF generate and vLLM, same prompts, bf16."""
    import vllm_engine

    if device.type != "cuda" or not vllm_engine.available():  # (on a CPU: bench/engine_compare.py)
        print("vllm: not measured (needs a GPU and vLLM installed)")
        return
    from engine_compare import compare

    r = compare(path, prompts, a.group_size, a.max_new_tokens, device, torch.bfloat16)
    print(f"generation, same prompts and lengths: hf {r['hf']:.0f}, vllm {r['vllm']:.0f} tokens/s "
          f"(vllm / hf {r['ratio']:.2f})")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_random_model(shape, folder: Path) -> str:
    """A random-init Qwen2 of `shape` with the tiny tokenizer and its vocabulary (random weights: what matters here
    is the shape; the output head is then far smaller than a real checkpoint's 152k rows)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from data.build_tiny_model import build_tokenizer

    if not (folder / "config.json").exists():
        tok = build_tokenizer()
        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                          num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                          intermediate_size=shape.intermediate, tie_word_embeddings=shape.tied, max_position_embeddings=4096,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder)


if __name__ == "__main__":
    sys.exit(main())
