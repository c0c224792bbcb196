"""Generation throughput of the two rollout engines, HF generate and vLLM (support/vllm.py), on the
same prompts and lengths: every sequence runs to exactly --new-tokens (no end token stops it), so
both make the same tokens.

Usage:
  python bench/engine_compare.py               # data/tiny_model and a random Qwen2.5-0.5B shape
  python bench/engine_compare.py --models tiny --sequences 256 --new-tokens 48

Prints tokens/s of each engine and the ratio vllm / hf per model (the median of --repeats timed
calls after one warm-up call each). The Qwen2.5-0.5B shape (bench/memory_plan.SHAPES, its real
151,936-row vocabulary) is built with random weights in /tmp; its prompts are the tiny tokenizer's
ids. Needs vLLM (requirements-vllm.txt)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
from bench import cli

MODELS = ("tiny", "qwen0.5b")


def qwen05_folder(folder: Path) -> str:
    """A random-init Qwen2.5-0.5B-shaped model (its real vocabulary) with the tiny tokenizer."""
    from memory_plan import SHAPES
    from transformers import AutoModelForCausalLM, Qwen2Config

    from data.build_tiny_model import build_tokenizer

    if not (folder / "config.json").exists():
        s, tok = SHAPES["Qwen/Qwen2.5-0.5B"], build_tokenizer()
        cfg = Qwen2Config(
            vocab_size=s.vocab,
            hidden_size=s.hidden,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads,
            intermediate_size=s.intermediate,
            tie_word_embeddings=s.tied,
            max_position_embeddings=4096,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder)


def timed_median(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare(
    path: str,
    prompts: list[list[int]],
    group: int,
    new_tokens: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    repeats: int = 1,
) -> dict:
    """{"hf": tokens/s, "vllm": tokens/s, "ratio": vllm / hf} for len(prompts) × group sequences of
    exactly `new_tokens` tokens each, on the model folder `path` (bench/gpu_check.py calls this on a
    GPU)."""
    from rollout import RolloutConfig, generate
    from support import vllm as vllm_engine
    from support.models import load_pretrained

    cfg = RolloutConfig(
        group_size=group,
        max_new_tokens=new_tokens,
        gen_batch_size=len(prompts) * group,
        vllm_kv_cache_gb=0.0 if device.type == "cuda" else 2.0,
    )
    tokens = len(prompts) * group * new_tokens
    model, tok = load_pretrained(path, dtype=dtype)
    model.to(device)
    hf = timed_median(lambda: generate(model, tok, prompts, cfg, []), repeats)
    model.to("meta")  # its memory back before the engine loads its own copy
    engine = vllm_engine.Engine(path, cfg, dtype, device, max(map(len, prompts)) + new_tokens)
    try:
        vllm = timed_median(lambda: engine.generate(tok, prompts, cfg, [], key=("bench",)), repeats)
    finally:
        engine.close()
    return {"hf": tokens / hf, "vllm": tokens / vllm, "ratio": hf / vllm}


def main(argv: list[str] | None = None) -> int:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--models", type=cli.names(MODELS), default=",".join(MODELS),
                    help="comma list of tiny, qwen0.5b")
    ap.add_argument("--sequences", type=cli.positive_int, default=64, help="prompts × group size")
    ap.add_argument("--group-size", type=cli.positive_int, default=8)
    ap.add_argument("--new-tokens", type=cli.positive_int, default=64)
    ap.add_argument("--repeats", type=cli.positive_int, default=1)
    ap.add_argument("--threads", type=cli.positive_int, default=2)
    a = ap.parse_args(argv)
    if a.sequences % a.group_size:
        ap.error(f"--sequences {a.sequences} is not a multiple of --group-size {a.group_size}")
    ap.need("vllm", install="pip install -r requirements-vllm.txt")
    from data.build_tiny_model import build_tokenizer

    torch.set_num_threads(a.threads)
    tok = build_tokenizer()
    prompts = [tok(f"{i}+{i * 7}-{i * 3}")["input_ids"] for i in range(a.sequences // a.group_size)]
    paths = {
        "tiny": str(REPO / "data" / "tiny_model"),
        "qwen0.5b": qwen05_folder(Path("/tmp/engine_qwen05")),
    }
    print(
        f"{len(prompts)} prompts × {a.group_size} = {a.sequences} sequences × {a.new_tokens} new "
        f"tokens, float32, {a.threads} threads, cpu"
    )
    print("| model | hf tokens/s | vllm tokens/s | vllm / hf |\n|---|---:|---:|---:|")
    for name in a.models:
        r = compare(
            paths[name], prompts, a.group_size, a.new_tokens, torch.device("cpu"), repeats=a.repeats
        )
        print(f"| {name} | {r['hf']:.0f} | {r['vllm']:.0f} | {r['ratio']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
