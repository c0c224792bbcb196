"""Memory per GPU for the paper configs, from a formula you can check.

Usage:
  python bench/memory_plan.py   # docs/gpu.md's tables: every paper config, ddp / fsdp, 1 and 8
                                # GPUs of 80 GB; each LoRA twin on one GPU

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
Checked on the CPU by `--measure` (removed after 8809cc6: docs/performance.md) and on GPUs
(docs/gpu.md).
"""

from __future__ import annotations

import sys
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


def main() -> None:
    from bench import cli  # (here: gpu_check and the tests import this module for its tables)

    cli.Parser(__file__, __doc__).parse_args()
    print(paper_table())
    print()
    print(lora_table())


if __name__ == "__main__":
    main()
