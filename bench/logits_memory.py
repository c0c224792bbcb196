"""Peak host memory per logit of one row's log-probs: support.logprobs.completion_logprobs forward
(with entropy) and backward.

Usage:
  python bench/logits_memory.py              # one 4,096-token row, vocabulary 151,936 (~5 min)
  python bench/logits_memory.py --tokens 1024 --layers 2

A random-init Qwen2.5-0.5B-shaped model with --layers decoder layers, float32, on this CPU. Prints
the peak RSS above the resident model (Linux VmHWM, reset before the pass) divided by tokens ×
vocabulary. The issue's bound: ≤ 3 bytes per logit (the whole logits, their float32 log-softmax and
its gradient took 19.6). What remains is mostly fixed: the output layer's weight gradient and, its
weight being tied, the embedding's dense gradient (2 × 4 bytes × V × H = 1.1 GB), then one chunk
of logits (support.logprobs.HEAD_CHUNK) and the decoder layers' activations.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cli
from support.logprobs import completion_logprobs


def status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: now, VmHWM: peak since the reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--tokens", type=cli.positive_int, default=4096)
    ap.add_argument("--vocab", type=cli.positive_int, default=151936)
    ap.add_argument("--layers", type=cli.positive_int, default=1)
    ap.add_argument("--prompt", type=cli.positive_int, default=16,
                    help="prompt tokens (the rest: completion)")
    a = ap.parse_args(argv)
    if a.prompt >= a.tokens:
        ap.error(f"--prompt {a.prompt} leaves no completion in --tokens {a.tokens}")
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=a.vocab, hidden_size=896, num_hidden_layers=a.layers, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
        max_position_embeddings=max(4096, a.tokens)))
    tokens = torch.randint(0, a.vocab, (1, a.tokens))
    prompt_len, seq_len = torch.tensor([a.prompt]), torch.tensor([a.tokens])
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base, t0 = status("VmRSS"), time.time()
    logp, ent = completion_logprobs(model, tokens, prompt_len, seq_len, 1.0, with_entropy=True)
    logp.sum().backward()
    peak, logits = status("VmHWM") - base, a.tokens * a.vocab
    print(f"{a.tokens} tokens × {a.vocab} vocabulary, {a.layers} layer(s): peak "
          f"+{peak / 1e9:.2f} GB above the model = {peak / logits:.2f} bytes per logit "
          f"({time.time() - t0:.0f} s; mean entropy {ent[0, a.prompt:].mean():.2f})")


if __name__ == "__main__":
    main()
