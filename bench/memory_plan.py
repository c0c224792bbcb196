"""Memory per GPU for the paper configs, from a formula you can check, and a CPU measurement that
checks it.

Usage:
  python bench/memory_plan.py \
      # docs/gpu.md's table: every paper config, ddp / fsdp, 1 and 8 GPUs of 80 GB
  python bench/memory_plan.py --measure            # a random-init Qwen2.5-0.5B-shaped model
                                                   # trained on this CPU: peak RSS vs the formula
  python bench/memory_plan.py --measure --lora 32  # the same with rank-32 adapters on a frozen base

The formula (bytes per GPU; P parameters, P_layer those of one decoder layer, N GPUs sharing them
under fsdp):
  weights      4·P        float32 master weights            (/N under fsdp, + 2·2·P_layer of
                                                             gathered bf16 layers)
  gradients    4·P        float32                           (/N under fsdp)
  optimizer    8·P        AdamW's two float32 moments       (/N under fsdp)
  activations  with gradient checkpointing: L·b·T·H·a (each layer's input)
               + b·T·(4H + 3·(n_q + 2·n_kv)·d + 4I)·a·2 (one layer recomputed, with its gradients);
               without it, L times the second term. b = micro-batch rows,
               T = prompt + response tokens (b·T = optim.micro_batch_tokens when set),
               a = bytes of the compute dtype (2 for bf16)
  logits       2·4·C + 4·V·H (+ 4·V·H when a = 2): the output layer runs in chunks of
               C = support.logprobs.HEAD_CHUNK float32 logits, recomputed in backward
               (two (chunk, V) temporaries), its float32 weight gradient before it is accumulated
               (none under LoRA: the output layer is frozen), and the float32 copy of bf16 weights
  logprob pass the no-grad passes for π at the start of a step (optim.minibatches > 1) and the
               reference (beta > 0):
               b_lp·T·H·8a + 2·4·C (+ 4·V·H when a = 2), b_lp = optim.logprob_batch_size
  generation   under fsdp the full bf16 weights 2·P, gathered once for the whole phase, plus the
               larger of its two moments: the prompt's pass, the prompt's KV cache
               gen_batch·P_len·L·2·n_kv·d·2 (bf16) beside one layer's activations
               gen_batch·P_len·(3·I + 4·H + 2·d)·a (the MLP's gate, up and product, four hidden
               states, the rotary tables), and a decoding step, the whole KV cache
               gen_batch·T·L·2·n_kv·d·2 beside the float32 copy of the output layer (4·V·H,
               when a = 2) and the sampler's five float32 (gen_batch, V) tensors. (The cache
               takes its full length at the first decoding step: support.kvcache._KVCache.)
  optim. step  4·P of temporaries in AdamW's foreach update (/N under fsdp)
LoRA (model.lora.rank r > 0; P_A = r · Σ (fan-in + fan-out) over the linear layers of every block):
  weights a·P (the frozen base, in the compute dtype) + 4·P_A; gradients 4·P_A; optimizer 8·P_A;
  optimizer step 4·P_A; logits 2·4·C (+ 4·V·H when a = 2); no-grad passes, activations and
  generation as above.
Training, the no-grad passes, generation and the optimizer step do not overlap in time. Weights and
AdamW's state are resident; gradients live from the first backward of an update to its end (set to
None there), so only the training phase and the optimizer step hold them: peak = weights + optimizer
+ max(gradients + activations + logits, gradients + optimizer step, no-grad pass, generation).
Before the first optimizer step AdamW has no state yet: `first_step_peak` (what bench/gpu_check.py
measures) = weights + max(gradients + activations + logits, gradients + optimizer + optimizer step,
no-grad pass, generation). Not counted: the CUDA context and allocator fragmentation (plan 2-4 GB of
headroom per GPU); under LoRA with optim.epochs > 1, the gate's float32 gradient of the frozen
output layer and its sum (2·4·V·H; no paper config sets epochs).
--measure runs each configuration in a child process of its own, on one thread, with glibc's
mmap threshold fixed at 128 KiB: by default glibc raises that threshold up to 32 MiB as blocks are
freed, then keeps freed layer-sized blocks in its heap (1.1-1.3 GB of free heap during a LoRA
step, mallinfo2), so the RSS would count the CPU allocator's fragmentation, not the tensors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool

    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden + (q + 2 * kv) * self.qkv_bias
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def lora_params(self, rank: int) -> int:
        """Adapter parameters at rank r on every linear layer of a block: r · (fan-in + fan-out)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        H, inter = self.hidden, self.intermediate
        # q, k, v, o, gate, up, down
        fans = (H + q) + 2 * (H + kv) + (q + H) + 2 * (H + inter) + (inter + H)
        return self.layers * rank * fans

    def params(self) -> int:
        return (self.layers * self.layer_params()
                + self.vocab * self.hidden * (1 if self.tied else 2)
                + self.hidden)


SHAPES = {  # from the models' public config.json files
    "Qwen/Qwen2.5-0.5B": Shape(896, 24, 14, 2, 64, 4864, 151936, True, True),
    "Qwen/Qwen2.5-1.5B": Shape(1536, 28, 12, 2, 128, 8960, 151936, True, True),
    "Qwen/Qwen3-4B-Base": Shape(2560, 36, 32, 8, 128, 9728, 151936, True, False),
    "Qwen/Qwen2.5-7B": Shape(3584, 28, 28, 4, 128, 18944, 152064, False, True),
    "Qwen/Qwen2.5-Math-7B": Shape(3584, 28, 28, 4, 128, 18944, 152064, False, True),
    "Elliott/Qwen2.5-Math-7B-16k-think": Shape(3584, 28, 28, 4, 128, 18944, 152064, False, True),
}


def estimate(s: Shape, *, gpus: int, fsdp: bool, micro_batch: int, gen_batch: int, prompt: int,
             response: int,
             checkpointing: bool = True, act_bytes: int = 2, logprob_batch: int = 0,
             lora_rank: int = 0, micro_tokens: int = 0) -> dict[str, float]:
    """Bytes per GPU of each part (see the module docstring); `peak` is their sum as the phases add
    up. With lora_rank > 0 the base is frozen in the compute dtype and only the adapters (P_A)
    carry float32 weights, gradients and AdamW state."""
    from support.logprobs import HEAD_CHUNK

    P, shard = s.params(), (gpus if fsdp else 1)
    T, a = prompt + response, act_bytes
    bT = micro_tokens or micro_batch * T  # tokens of one micro-batch
    layer = bT * (4 * s.hidden + 3 * (s.heads + 2 * s.kv_heads) * s.head_dim
                  + 4 * s.intermediate) * a * 2
    upcast = 4 * s.vocab * s.hidden * (a < 4)  # bf16 output-layer weights copied to float32
    trained = s.lora_params(lora_rank) if lora_rank else P  # what has gradients and AdamW state

    def kv(tokens: int) -> int:  # the KV cache of gen_batch rows of `tokens`, bf16
        return gen_batch * tokens * s.layers * 2 * s.kv_heads * s.head_dim * 2

    prefill = gen_batch * prompt * (3 * s.intermediate + 4 * s.hidden + 2 * s.head_dim) * a
    decode = upcast + 5 * gen_batch * s.vocab * 4  # the float32 head, the sampler's (rows, V)
    base = (a if lora_rank else 4) * P / shard  # a frozen base is held in the compute dtype
    parts = {
        "weights": base + (4 * trained / shard if lora_rank else 0)
        + (4 * s.layer_params() if fsdp else 0),
        "gradients": 4 * trained / shard,
        "optimizer": 8 * trained / shard,
        "activations": ((s.layers * bT * s.hidden * a + layer) if checkpointing
                        else s.layers * layer / 2),
        "logits": 2 * 4 * HEAD_CHUNK + 4 * s.vocab * s.hidden * (not lora_rank) + upcast,
        "logprob_pass": (logprob_batch * T * s.hidden * a * 8 + 2 * 4 * HEAD_CHUNK + upcast)
        * bool(logprob_batch),
        "generation": (2 * P if fsdp else 0) + max(kv(prompt) + prefill, kv(T) + decode),
        "optimizer_step": 4 * trained / shard,
    }
    w, g, opt = parts["weights"], parts["gradients"], parts["optimizer"]
    training = g + parts["activations"] + parts["logits"]
    others = max(parts["logprob_pass"], parts["generation"])
    parts["peak"] = w + opt + max(training, g + parts["optimizer_step"], others)
    parts["first_step_peak"] = w + max(training, g + opt + parts["optimizer_step"], others)
    return parts


PAPERS = Path(__file__).resolve().parents[1] / "configs" / "papers"


def config_estimate(cfg, gpus: int, parallel: str) -> dict[str, float]:
    """`estimate` for a config.Config run on `gpus` GPUs under model.parallel = `parallel`."""
    o = cfg.optim
    no_grad_rows = o.logprob_batch_size * (o.minibatches > 1 or cfg.grpo.beta > 0)
    return estimate(SHAPES[cfg.model.path], gpus=gpus, fsdp=parallel == "fsdp" and gpus > 1,
                    micro_batch=o.micro_batch_size, gen_batch=cfg.rollout.gen_batch_size,
                    prompt=cfg.data.max_prompt_tokens, response=cfg.rollout.max_new_tokens,
                    checkpointing=cfg.model.gradient_checkpointing, logprob_batch=no_grad_rows,
                    lora_rank=cfg.model.lora.rank, micro_tokens=o.micro_batch_tokens)


def gb(e: dict, keys: tuple) -> str:
    return " | ".join(f"{e[k] / GB:.1f}" for k in keys)


def paper_table(budget_gb: float = 80) -> str:
    from config import load_config

    rows = [("| config | model (params) | GPUs | parallel | weights | grads | AdamW | "
             "activations | logits | "
             "no-grad pass | generation | peak per GPU | fits 80 GB |"),
            "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    keys = ("weights", "gradients", "optimizer", "activations", "logits", "logprob_pass",
            "generation", "peak")
    for path in sorted(PAPERS.glob("*.yaml")):
        if path.name == "gpu_base.yaml" or path.stem.endswith("_lora"):
            continue
        cfg = load_config(str(path), [])
        s = SHAPES[cfg.model.path]
        for gpus in (1, 8):
            for parallel in ("ddp", "fsdp"):
                e = config_estimate(cfg, gpus, parallel)
                mark = " ← config" if parallel == cfg.model.parallel and gpus == 8 else ""
                fits = "yes" if e["peak"] < budget_gb * GB else "no"
                model = f"{cfg.model.path} ({s.params() / 1e9:.2f} B)"
                cells = [f"{path.stem}{mark}", model, str(gpus), parallel, gb(e, keys), fits]
                rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows)


def lora_table() -> str:
    """One GPU: each configs/papers/*_lora.yaml (its paper config, adapters on a bf16 base)."""
    from config import load_config

    rows = [("| LoRA config (1 GPU) | model | rank | adapter params | base (bf16) | "
             "adapters + grads + AdamW | activations | logits | no-grad pass | generation | peak | "
             "fits 80 GB | fits 141 GB |"),
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    keys = ("activations", "logits", "logprob_pass", "generation", "peak")
    for path in sorted(PAPERS.glob("*_lora.yaml")):
        cfg = load_config(str(path), [])
        s, rank = SHAPES[cfg.model.path], cfg.model.lora.rank
        e = config_estimate(cfg, 1, "ddp")
        adapters = 16 * s.lora_params(rank)  # float32 weights, gradients, two AdamW moments
        fits = ["yes" if e["peak"] < budget * GB else "no" for budget in (80, 141)]
        cells = [path.stem, cfg.model.path, str(rank), f"{s.lora_params(rank) / 1e6:.1f} M",
                 f"{2 * s.params() / GB:.1f}", f"{adapters / GB:.2f}", gb(e, keys), *fits]
        rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows)


def peak_rss(reset: bool = False) -> int:
    """This process's peak RSS (VmHWM) in bytes; `reset` starts a new peak from the RSS now."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def measure(lora_rank: int, steps: int) -> None:
    """`measured` in a child process of its own (see the module docstring)."""
    env = os.environ | {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}
    cmd = [sys.executable, __file__, "--child", "--lora", str(lora_rank), "--steps", str(steps)]
    subprocess.run(cmd, env=env, check=True)


def measured(steps: int, lora_rank: int, micro_batch: int = 4, prompt: int = 32,
             response: int = 96) -> None:
    """Train a random-init Qwen2.5-0.5B-shaped model (its real vocabulary size; random token ids, so
    no tokenizer is needed) for a few AdamW steps through grpo.update_policy on this CPU, float32
    compute, gradient checkpointing on (so rows run whole, as under FSDP), and compare peak RSS with
    the formula's CPU figure plus the process's RSS before the model existed. lora_rank > 0:
    adapters of that rank on every linear layer train instead."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import grpo
    from config import Config, update_settings
    from batch import Rollouts
    from support import lora
    from support.models import checkpoint_activations

    if lora_rank:  # peft's share of the process is counted in the process before the model
        importlib.import_module("peft")
    torch.set_num_threads(1)
    base = peak_rss()  # imports done: the interpreter's own share
    s = SHAPES["Qwen/Qwen2.5-0.5B"]
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, intermediate_size=s.intermediate,
        tie_word_embeddings=s.tied,
        max_position_embeddings=4096))
    checkpoint_activations(model)
    model.config.use_cache = False
    if lora_rank:
        model = lora.add_adapters(model, lora.LoraConfig(rank=lora_rank), seed=0)
    model.eval()  # as load_pretrained leaves it: grpo.update_policy trains in train mode
    trained = [p for p in model.parameters() if p.requires_grad]
    n_all, n_trained = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in trained)
    print(f"{n_all / 1e6:.1f} M parameters (formula: {s.params() / 1e6:.1f} M + "
          f"{s.lora_params(lora_rank) / 1e6:.1f} M of adapters); trained: {n_trained / 1e6:.1f} M")
    cfg = Config()
    cfg.model.gradient_checkpointing, cfg.optim.micro_batch_size = True, micro_batch
    # foreach as torch picks on a GPU: on the CPU it defaults to a per-tensor loop whose
    # temporaries are one parameter's, not the formula's 4·P
    optimizer = torch.optim.AdamW(trained, lr=1e-6, foreach=True)
    peak_rss(reset=True)  # random init's temporaries (~0.5 GB above the model) are not training's
    B, L = 2 * micro_batch, prompt + response
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        t0 = time.time()
        tokens = torch.randint(0, s.vocab, (B, L), generator=g)
        batch = Rollouts(tokens=tokens, prompt_len=torch.full((B,), prompt),
                         seq_len=torch.full((B,), L),
                         behav_logp=torch.zeros(B, L), truncated=torch.zeros(B, dtype=torch.bool),
                         prompt_idx=torch.arange(B), group=torch.arange(B) // 2,
                         born=torch.zeros(B, dtype=torch.long),
                         reward=torch.zeros(B), correct=torch.zeros(B, dtype=torch.bool),
                         advantage=torch.randn(B, generator=g),
                         entropy=torch.zeros(B), replayed=torch.zeros(B, dtype=torch.bool),
                         onpolicy=torch.ones(B, dtype=torch.bool),
                         slot=torch.full((B,), -1))
        _, _, reasons, _ = grpo.update_policy(update_settings(cfg), model, model, optimizer, batch,
                                              torch.device("cpu"))
        peak = peak_rss()
        print(f"step {step + 1}: {reasons[0] or 'ok'}, {time.time() - t0:.0f} s, "
              f"peak RSS {peak / GB:.2f} GB")
    e = estimate(s, gpus=1, fsdp=False, micro_batch=micro_batch, gen_batch=0, prompt=prompt,
                 response=response,
                 act_bytes=4, lora_rank=lora_rank)
    expected = base + e["peak"]
    print("formula: "
          f"{' + '.join(f'{k} {v / GB:.2f}' for k, v in e.items() if 'peak' not in k)} GB; "
          f"+ process before the model {base / GB:.2f} GB = {expected / GB:.2f} GB")
    print(f"measured peak RSS {peak / GB:.2f} GB: "
          f"{100 * (peak / expected - 1):+.1f} % against the formula")


def main() -> None:
    from bench import cli  # (here: gpu_check and the tests import this module for its tables)

    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--measure", action="store_true",
                    help="run the CPU measurement instead of printing the table")
    ap.add_argument("--steps", type=cli.positive_int, default=2,
                    help="2: AdamW's state exists from step 2 on")
    ap.add_argument("--lora", type=cli.count, default=0,
                    help="--measure with LoRA adapters of this rank")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        measured(a.steps, a.lora)
    elif a.measure:
        measure(a.lora, a.steps)
    else:
        print(paper_table())
        print()
        print(lora_table())


if __name__ == "__main__":
    main()
