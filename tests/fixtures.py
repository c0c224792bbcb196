"""Model folders shaped like real checkpoints, built in the tests (random tiny weights, nothing
downloaded).

Each follows the public files of one family: which special tokens exist, which one the tokenizer
calls eos, the chat template's turn markers (and a default system prompt where the family has
one), BOS handling, and a generation_config.json with that family's end-token list and sampling
defaults:

  qwen25_instruct  Qwen2.5-Instruct: ChatML, eos <|im_end|>, generation_config eos [<|im_end|>,
                   <|endoftext|>], repetition_penalty 1.05, temperature 0.7, top_p 0.8, top_k 20;
                   default system turn
  qwen3_base       Qwen3-Base: ChatML template, but eos <|endoftext|> (the end of turn is not eos)
  llama3_instruct  Llama-3-Instruct: BOS <|begin_of_text|> added by the tokenizer and written by
                   the template, header tokens, eos <|eot_id|>, generation_config eos
                   [<|end_of_text|>, <|eom_id|>, <|eot_id|>], temperature 0.6, top_p 0.9, no pad
                   token

`build(kind, folder, emit=...)` writes a folder that `AutoTokenizer` / `AutoModelForCausalLM`
load. With `emit`, the weights are set so that the model deterministically continues a prompt
with `emit` and then its end-of-turn token (a bigram chain: attention and MLP outputs are zeroed,
so each next token depends on the current token only).

`train_here(...)` runs train.py's main in the test's own process; `torchrun(...)` runs processes
under torchrun; a `--worker` writes its result per rank with
`write_result`, and `worker_results` runs one and reads what its ranks wrote.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from support.util import run_capped
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

REPO = Path(__file__).resolve().parents[1]
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHATML = (
    "{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_DEFAULT_SYSTEM = (  # Qwen2.5-Instruct inserts a system turn when the conversation has none
    "{%- if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + CHATML
)
LLAMA3 = (
    "{{ bos_token }}{%- for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
    " + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

KINDS = {
    "qwen25_instruct": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "eos": "<|im_end|>",
        "pad": "<|endoftext|>", "bos": None,
        "template": CHATML_DEFAULT_SYSTEM, "end_of_turn": "<|im_end|>", "arch": "qwen2",
        "tokenizer_class": "Qwen2Tokenizer",
        "generation": {"do_sample": True, "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
                        "pad_token_id": "<|endoftext|>",
                        "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}},
    "qwen3_base": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "eos": "<|endoftext|>",
        "pad": "<|endoftext|>", "bos": None,
        "template": CHATML, "end_of_turn": "<|im_end|>", "arch": "qwen3",
        "tokenizer_class": "Qwen2Tokenizer",
        "generation": {"eos_token_id": "<|endoftext|>", "bos_token_id": "<|endoftext|>",
                        "max_new_tokens": 2048}},
    "llama3_instruct": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                     "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"],
        "eos": "<|eot_id|>", "pad": None, "bos": "<|begin_of_text|>", "template": LLAMA3,
        "end_of_turn": "<|eot_id|>", "arch": "llama",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "generation": {"do_sample": True, "bos_token_id": "<|begin_of_text|>",
                        "temperature": 0.6, "top_p": 0.9,
                        "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]}},
}


def build_tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the 256 byte symbols (no merges), with the family's special tokens
    first."""
    spec = KINDS[kind]
    vocab = {t: i for i, t in enumerate(spec["specials"]
                                        + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    if spec["bos"]:  # Llama 3's tokenizer puts BOS in front of plain text itself
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec['bos']} $A", pair=f"{spec['bos']} $A $B",
            special_tokens=[(spec["bos"], vocab[spec["bos"]])])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=spec["eos"], pad_token=spec["pad"], bos_token=spec["bos"],
        additional_special_tokens=[t for t in spec["specials"]
                                   if t not in (spec["eos"], spec["pad"], spec["bos"])])
    hf.chat_template = spec["template"]
    return hf


def build(kind: str, folder: Path, emit: str | None = None, seed: int = 0) -> Path:
    """Write a model folder of `kind` (random weights, or the `emit` chain described in the
    module docstring)."""
    spec, tok = KINDS[kind], build_tokenizer(kind)
    ids = {t: tok.convert_tokens_to_ids(t) for t in spec["specials"]}
    common = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512,
              "tie_word_embeddings": emit is None,
              "eos_token_id": ids[spec["eos"]],
              "pad_token_id": ids[spec["pad"]] if spec["pad"] else None,
              "bos_token_id": ids[spec["bos"]] if spec["bos"] else None}
    config = {"qwen2": Qwen2Config, "qwen3": Qwen3Config,
              "llama": LlamaConfig}[spec["arch"]](**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if emit is not None:
        chain = tok(emit, add_special_tokens=False)["input_ids"] + [ids[spec["end_of_turn"]]]
        set_chain(model, [turn_start_token(tok)] + chain)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps(cfg | {"tokenizer_class": spec["tokenizer_class"]}, indent=2))
    gen = {k: ([ids[x] for x in v] if isinstance(v, list)
               else ids.get(v, v) if isinstance(v, str) else v)
           for k, v in spec["generation"].items()}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return folder


def turn_start_token(tok) -> int:
    """The last token of a chat prompt (what the assistant's first token follows)."""
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"][-1]


@torch.no_grad()
def set_chain(model, chain: list[int], margin: float = 60.0) -> None:
    """Make `model` a bigram machine: after chain[i] it emits chain[i + 1] with probability ≈ 1
    (logit margin 60). Tokens of the chain must be distinct. Every layer's output projections are
    zeroed, so the residual stream is the current token's embedding: one-hot per chain token, read
    out by lm_head rows."""
    if len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError("set_chain: the chain's tokens must be distinct")
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            p.zero_()
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    emb.zero_()
    head.zero_()
    for d, (cur, nxt) in enumerate(itertools.pairwise(chain)):
        emb[cur, d] = 1.0
        # RMSNorm(e_d) = √H·w_d·e_d
        head[nxt, d] = margin / (emb.shape[1] ** 0.5 * model.model.norm.weight[d].item())


# ------------------------------------------------------------------------------- train.py in here


def main_here(main, argv) -> subprocess.CompletedProcess:
    """A command's `main(argv)` in this process: what a subprocess of it runs, without the 5-10 s
    each one spends importing torch and transformers. Its exit code (returned, or SystemExit's),
    stdout and stderr captured (a bug raises here, with its traceback); the signal handlers a run
    installs (support/preempt.STOP) are put back after it."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    except SystemExit as e:
        code = e.code
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def train_here(*argv: str) -> subprocess.CompletedProcess:
    """`python train.py *argv` from the repository's root, through main_here. For tests of what a
    run does and writes; a test of the command line as a user meets it (exit code, the one line on
    stderr, a signal, the process's environment) runs a subprocess."""
    import train

    with contextlib.chdir(REPO):
        return main_here(train.main, argv)


# ---------------------------------------------------------------------------------------- torchrun

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}


def torchrun(*args: str, n: int = 2, timeout: int = 400) -> subprocess.CompletedProcess:
    """n processes under torchrun in the repository, which must exit 0; on a timeout the launcher
    and its workers are killed (no orphan survives)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launch, f"--nproc_per_node={n}", *args]
    code, out, err = run_capped(cmd, timeout, cwd=REPO, env=ENV)
    if code is None:
        pytest.fail(f"torchrun timed out after {timeout}s: {err[-4000:]}")
    assert code == 0, err[-4000:]
    return subprocess.CompletedProcess(cmd, code, out, err)


F32_EPS = torch.finfo(torch.float32).eps  # one float32 rounding step, relative


def f32_tol(magnitude: float, terms: int = 1, steps: float = 2.0) -> float:
    """How far two float32 results that sum the same `terms` numbers in different orders (chunks,
    kernels, micro-batches) may differ: `steps` rounding steps at the sum's `magnitude`, grown as
    √terms (rounding errors add like a random walk). Derived, not measured on one machine."""
    return steps * F32_EPS * float(magnitude) * float(terms) ** 0.5


def write_result(out: str | Path, result: dict) -> None:
    """Under torchrun: this rank's result, read back by `worker_results`."""
    Path(f"{out}.rank{dist.get_rank()}").write_text(json.dumps(result))


def worker_results(script: str | Path, *args: str, out: Path,
                   worker: str = "--worker") -> list[dict]:
    """`script worker *args out` under torchrun on two ranks: what each rank wrote."""
    torchrun(str(script), worker, *args, str(out))
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


# --------------------------------------------------------------------------------------- bad input


def previous_run(out: Path) -> dict[str, bytes]:
    """A finished-looking run in `out` (marked as a run's); returns its files, which a refused
    command may not change."""
    checkpoint = out / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    (out / ".run").write_text('{"created": 0}\n')
    (checkpoint / "state_rank0.pt").write_bytes(b"weights of a week-long run")
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    return snapshot(out)


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file below `out`, by its relative path."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
