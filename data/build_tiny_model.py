"""Build the embedded default model: a byte-level BPE tokenizer and a ~0.8 M-parameter Qwen2
causal LM, warm-started by a supervised pass on worked solutions of the tiny task, saved with
`save_pretrained`.

Usage:
  python -m data.build_tiny_model  # writes data/tiny_model/ (deterministic, ~11 min on one core)
  python -m data.build_tiny_model --out DIR --sft-steps 300

The result loads like any Hugging Face model:
  AutoTokenizer.from_pretrained("data/tiny_model");
  AutoModelForCausalLM.from_pretrained("data/tiny_model")

Why the warm start uses label smoothing (0.1). The model should start weak when sampled (10-40% at
T = 1 on the held-out split) in a way RL can fix on problems it never trains on. A model that is
weak because it is undertrained (the plain recipe stopped at 1,100 steps: 23.5% sampled, 32% greedy)
knows little that RL can sharpen, and GRPO on it learned its training prompts without moving
held-out accuracy (docs/results.md). Label smoothing, a standard SFT regulariser, keeps ~10% of each
token's probability off the target: the greedy answer is right on 80% of held-out problems, but a
T = 1 sample slips somewhere in its ~10-25 tokens most of the time (20% sampled accuracy). That gap,
pass@k well above pass@1, is what RL with a verifier closes on real base models too; here it does
so in a few minutes. `build_info.json` records what the build measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from data.tiny_task import make_split

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Words every prompt and answer repeats get one token each (BPE merges), which makes sequences
# shorter.
WORDS = ["user", "assistant", "boxed"]
# Qwen2's pre-tokenizer: digits split one by one, letters grouped, punctuation runs grouped.
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with Qwen2's pre-tokenizer: the 256 byte symbols plus merges for WORDS only.

    It has exactly the structure transformers' Qwen2Tokenizer rebuilds from vocab and merges when
    AutoTokenizer loads a folder whose config says `qwen2`, so the reloaded tokenizer splits text
    exactly as this one does (a character-level WordLevel tokenizer would silently lose spaces and
    newlines there).
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(alphabet))}
    merges = []
    for word in WORDS:
        for i in range(2, len(word) + 1):
            merges.append((word[: i - 1], word[i - 1]))
            vocab.setdefault(word[:i], len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(vocab_size: int, pad_id: int, eos_id: int) -> torch.nn.Module:
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    return AutoModelForCausalLM.from_config(cfg)


def sft_batch(tok, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, attention mask and labels (-100 on the prompt and padding: learn the answer only)."""
    seqs, labels = [], []
    for r in rows:
        prompt = tok.apply_chat_template([{"role": "user", "content": r["problem"]}],
                                         tokenize=False, add_generation_prompt=True)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(r["solution"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + c)
        labels.append([-100] * len(p) + c)
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), tok.pad_token_id)
    lab = torch.full((len(seqs), L), -100)
    for i, (s, y) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)], lab[i, : len(y)] = torch.tensor(s), torch.tensor(y)
    return ids, (ids != tok.pad_token_id).long(), lab


def heldout_accuracy(model, tok, test: list[dict], temperature: float) -> float:
    """Fraction of held-out problems solved by one sample at `temperature` (0 = greedy), verified
    by rewards.py."""
    from rewards import RewardConfig, score_batch
    from rollout import RolloutConfig, generate
    from support.prompts import end_ids, prompt_ids

    prompts = [prompt_ids(tok, p["problem"], "{problem}", True) for p in test]
    sampling = RolloutConfig(group_size=1, max_new_tokens=48, temperature=temperature,
                             gen_batch_size=256)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        _, texts = generate(model, tok, prompts, sampling, end_ids(tok, model, True, []))
    correct = score_batch(texts, [p["answer"] for p in test], RewardConfig()).correct
    return sum(correct) / len(correct)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "tiny_model"))
    ap.add_argument("--sft-steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-int", type=int, default=20,
                    help="tiny task difficulty (keep equal to data.tiny.max_int)")
    ap.add_argument("--max-den", type=int, default=6,
                    help="tiny task difficulty (keep equal to data.tiny.max_den)")
    ap.add_argument("--n-problems", type=int, default=8000, help="distinct supervised problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoothing", type=float, default=0.1,
                    help="label smoothing of the supervised loss (see module docstring)")
    ap.add_argument("--eval-n", type=int, default=200,
                    help="held-out problems for the sampled-accuracy check")
    a = ap.parse_args()

    torch.set_num_threads(1)  # a 0.8 M-parameter model gains nothing from more threads on a CPU
    torch.manual_seed(a.seed)
    t0 = time.time()
    tok = build_tokenizer()
    model = build_model(len(tok), tok.pad_token_id, tok.eos_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    # Same distribution as the RL training split (held-out problems excluded), from its own seed:
    # the warm start teaches the format and some arithmetic, and RL must do the rest.
    difficulty = {"max_int": a.max_int, "max_den": a.max_den}
    data = make_split("train", a.n_problems, seed=10_000 + a.seed, **difficulty)
    test = make_split("test", a.eval_n, **difficulty)
    n_batches = -(-len(data) // a.batch_size)
    g = torch.Generator().manual_seed(a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / a.sft_steps))
    model.train()
    for step in range(a.sft_steps):
        # a new epoch: reshuffle which problems share a batch; tokenize once per epoch
        if step % n_batches == 0:
            order = torch.randperm(len(data), generator=g).tolist()
            batches = [sft_batch(tok, [data[i] for i in order[j : j + a.batch_size]])
                       for j in range(0, len(data), a.batch_size)]
        ids, mask, lab = batches[step % n_batches]
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), lab[:, 1:].flatten(),
                                                 ignore_index=-100,
                                                 label_smoothing=a.smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == a.sft_steps - 1:
            print(f"sft step {step:4d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s",
                  flush=True)
        if (step + 1) % 500 == 0:
            print(f"  held-out sampled accuracy {heldout_accuracy(model, tok, test, 1.0):.3f}",
                  flush=True)
            model.train()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)  # a fresh one: generate() left padding settings on `tok`

    # Check the round trip through the public loading path, and measure the starting accuracy.
    tok2 = AutoTokenizer.from_pretrained(out)
    model2 = AutoModelForCausalLM.from_pretrained(out)
    probe = tok.apply_chat_template([{"role": "user", "content": test[0]["problem"]}],
                                    tokenize=False, add_generation_prompt=True)
    probe += test[0]["solution"] + " \n"
    if tok(probe)["input_ids"] != tok2(probe)["input_ids"]:
        raise SystemExit(f"the reloaded tokenizer ({type(tok2).__name__}) splits text differently "
                         "from the one trained on")
    info = {
        "params": n_params,
        "sft_steps": a.sft_steps,
        "smoothing": a.smoothing,
        "seed": a.seed,
        "heldout_sampled_accuracy_t1": heldout_accuracy(model2, tok2, test, 1.0),
        "heldout_greedy_accuracy": heldout_accuracy(model2, tok2, test, 0.0),
        **difficulty,
        "eval_n": a.eval_n,
        "build_seconds": round(time.time() - t0, 1),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
