"""Evaluate a checkpoint on math benchmarks (`--compare`: compare training runs, see compare.py).

Usage:
  python eval.py --model data/tiny_model --benchmarks tiny --k 8 --max-new-tokens 48 \\
      --template "{problem}"
  python eval.py --model Qwen/Qwen2.5-Math-1.5B --benchmarks math500,gsm8k,aime24,aime25,amc23 \\
      --data-dir /path/to/benchmarks --k 8 --temperature 0.6 --limit 100 --out-dir eval_results/q
  python eval.py --compare runs/repro/none-s0 runs/repro/aper-s0 ...  # = python compare.py ...

Metrics (see the README): avg@k, pass@k, maj@k, tokens, trunc, entropy. A run's model is
evaluated into the run (`runs/x/final` → `runs/x/eval/final/results.json`); --overwrite replaces.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

import rewards
from config import ConfigError, DataConfig, check_flags
from data.loaders import NAMED, Problem, load_problems
from rollout import RolloutConfig, make_sampler
from analysis import compare
from support import parallel
from support.checks import MAX_EVAL_SAMPLES, MAX_STEP_TOKENS
from support.models import load_pretrained
from support.preempt import STOP, Interrupted, generating, should_stop
from support.prompts import (ChatTemplateError, build_prompts, end_ids, frame_fault,
                             template_warnings)
from support.locks import results_folder
from support.rundir import write_file
from support.util import OneLineParser, RunError, command_errors, oneline, path_fault


DEFAULT_TEMPLATE = ("{problem}\nPlease reason step by step, and put your final answer within "
                    "\\boxed{}.")
METRICS = ["accuracy", "pass@k", "maj@k", "response_len", "truncation_rate", "entropy"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of them correct, is)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def maj_at_k(answers: list[str | None], correct: list[bool]) -> float:
    """1.0 if the most frequent answer is correct. The correct samples are one vote bucket (each
    equals the gold), wrong ones vote by their text; no answer, no vote; a tie goes to the answer
    seen first (samples come in random order, so this favours no answer)."""
    votes = Counter()
    for answer, ok in zip(answers, correct, strict=True):
        if ok:
            votes[True] += 1  # a bool key never collides with a string
        elif answer is not None:
            text = re.sub(r"\\left|\\right|\\[!,; ]|\s|\$", "", answer)
            votes[text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")] += 1
    return float(bool(votes) and votes.most_common(1)[0][0] is True)


def evaluate(sampler, prompts: list[list[int]], golds: list, sampling: RolloutConfig, reward_cfg,
             desc: str | None = None, keep: bool = False, key: tuple = (),
             leave: bool = True) -> list[dict]:
    """`sampling.group_size` completions per prompt (token ids) from `sampler` (rollout.HFSampler
    or support/vllm.py's, seeded from `key`), verified against `golds`: one record per prompt. A
    tqdm bar if `desc`. A stop (preempt.should_stop) returns the records of the problems
    finished."""
    k, records = sampling.group_size, []
    per_call = max(1, sampling.gen_batch_size // k)  # prompts per generate call
    starts = range(0, len(prompts), per_call)
    for start in tqdm(starts, desc=desc, disable=desc is None, leave=leave):
        if should_stop():
            break
        chunk = prompts[start : start + per_call]
        try:
            ro, texts = sampler.generate(chunk, sampling, key=(*key, start))
        except Interrupted:
            break
        gold = [g for g in golds[start : start + per_call] for _ in range(k)]
        scored = rewards.score_batch(texts, gold, reward_cfg)
        for j in range(len(texts) // k):
            rows = range(j * k, (j + 1) * k)
            records.append(record(ro, texts, rows, scored, golds[start + j], keep))
    return records


def record(ro, texts: list[str], rows: range, scored, gold, keep: bool) -> dict:
    """One prompt's record from its `rows` of the batch and their `scored` (rewards.Scored)
    (`keep`: its completions' tokens too)."""
    rec = {"gold": gold, "correct": [bool(scored.correct[i]) for i in rows],
           "answers": [scored.answers[i] for i in rows],
           "tokens": ro.completion_len[rows].tolist(), "truncated": ro.truncated[rows].tolist(),
           "entropy": ro.entropy[rows].tolist(), "sample": texts[rows[0]]}  # a completion to read
    if keep:
        spans = [(i, slice(int(ro.prompt_len[i]), int(ro.seq_len[i]))) for i in rows]
        rec["completions"] = [texts[i] for i in rows]
        rec["behav_logp"] = [ro.behav_logp[i, span].tolist() for i, span in spans]
        rec["ids"] = [ro.tokens[i, span].tolist() for i, span in spans]
    return rec


def run_eval(sampler, model, compute, device, prompts: list, golds: list, cfg, step: int,
             rank: int) -> dict:
    """train.py's periodic held-out eval of `model` (its `sampler`, under `compute`) on this
    rank's share of `prompts` (token ids) and `golds`, with the run's config `cfg` (eval.*,
    rollout.*, reward.*, seed): each rank's share from its own fixed seed (how often we evaluate
    never changes training randomness); every rank gets the summary of all. A stop abandons it
    (Interrupted)."""
    e = cfg.eval
    sampling = replace(cfg.rollout, group_size=e.k, temperature=e.temperature, top_p=e.top_p,
                       top_k=0, max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens)
    desc = f"eval {step}" if rank == 0 else None  # a bar: a real eval takes minutes
    with parallel.fork_rng(device), generating(model, compute):
        torch.manual_seed(cfg.seed + rank)
        prompts = parallel.share(prompts)
        golds = parallel.share(golds)
        records = evaluate(sampler, prompts, golds, sampling, cfg.reward, desc, leave=False,
                           key=("eval", cfg.seed, rank))
        greedy = []
        if e.greedy:  # one more decode: each problem's most likely completion (no draws)
            argmax = replace(sampling, group_size=1, temperature=0.0, top_p=1.0, refill=False)
            greedy = evaluate(sampler, prompts, golds, argmax, cfg.reward, None,
                              key=("eval_greedy", cfg.seed, rank))
    summary = summarize(parallel.gather(records))
    if e.greedy:
        summary["greedy"] = statistics.fmean(rec["correct"][0] for rec in parallel.gather(greedy))
    return summary


def summarize(records: list[dict]) -> dict[str, float]:
    """Per-problem metrics averaged over problems (accuracy's standard error over problems too);
    lengths and truncation over samples; entropy a token mean (samples weigh by their length)."""
    correct = [r["correct"] for r in records]
    acc = [sum(c) / len(c) for c in correct]
    tokens = [t for r in records for t in r["tokens"]]
    entropy = sum(e * n for r in records for e, n in zip(r["entropy"], r["tokens"]))
    return {"accuracy": statistics.fmean(acc),
            "accuracy_se": statistics.stdev(acc) / len(acc) ** 0.5 if len(acc) > 1 else 0.0,
            "pass@k": statistics.fmean(pass_at_k(len(c), sum(c), len(c)) for c in correct),
            "maj@k": statistics.fmean(maj_at_k(r["answers"], r["correct"]) for r in records),
            "response_len": statistics.fmean(tokens),
            "truncation_rate": statistics.fmean(t for r in records for t in r["truncated"]),
            "entropy": entropy / max(1, sum(tokens)), "n": len(records)}


def macro(results: dict[str, dict]) -> dict[str, float]:
    """Every benchmark weighs the same."""
    means = {m: statistics.fmean(r[m] for r in results.values()) for m in METRICS}
    return means | {"n": sum(r["n"] for r in results.values())}


def results_table(results: dict[str, dict], k: int) -> str:
    """Markdown, a row per benchmark and the macro average; accuracies in percent."""
    if len(results) > 1:
        results = results | {"macro": macro(results)}
    lines = [f"| benchmark | problems | avg@{k} | pass@{k} | maj@{k} | tokens | trunc | entropy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        rates = " | ".join(f"{100 * r[m]:.1f}" for m in METRICS[:3])
        lines.append(f"| {name} | {r['n']} | {rates} | {r['response_len']:.1f} | "
                     f"{100 * r['truncation_rate']:.1f}% | {r['entropy']:.3f} |")
    return "\n".join(lines)


class BadInput(Exception):
    """Bad input: main prints it on one line and exits 2 (with --debug, its traceback)."""


def default_out_dir(model: str) -> Path:
    """A run's model is evaluated into that run (`runs/x/final` → `runs/x/eval/final`)."""
    path = Path(model).expanduser()
    run = next((p for p in (path.parent, path.parent.parent) if (p / ".run").is_file()), None)
    if run is None:
        return Path("eval_results") / path.name
    return run / "eval" / "_".join(path.relative_to(run).parts)


FLAGS = {"eval.k": "k", "eval.temperature": "temperature", "eval.top_p": "top_p",
         "rollout.max_new_tokens": "max_new_tokens", "rollout.gen_batch_size": "batch_size",
         "data.template": "template", "seed": "seed"}
"""eval.py's arguments that set a config key: the key -> the argument."""


def check_args(args) -> Path:
    """Refuses bad values, and outputs that exist or are not regular files, before anything
    loads; returns the output folder."""
    flags = {}
    for key, name in FLAGS.items():
        flags[key] = ("--" + name.replace("_", "-"), getattr(args, name))
    try:
        check_flags(flags)  # config.py's rules for the keys these flags set
    except ConfigError as e:
        raise BadInput(str(e)) from None
    if args.limit is not None and args.limit < 1:
        raise BadInput(f"--limit must be ≥ 1, got {args.limit}")
    for flag, path, suffix in (("--out-dir", args.out_dir, "/results.json"),
                               ("--save-correct", args.save_correct, ".meta.json")):
        fault = path_fault(path + suffix) if path is not None else None
        if fault:
            shown = repr(path) if len(path) < 60 else repr(path[:50]) + "..."
            raise BadInput(f"{flag} {shown} {fault}")
    out = Path(args.out_dir) if args.out_dir else default_out_dir(args.model)
    for f in (out / "results.json", Path(args.save_correct or "")):
        if f.is_file() and not args.overwrite:
            raise BadInput(f"{f} exists; pass --overwrite to replace it or --out-dir to write "
                           "elsewhere")
        if f.name and f.exists() and not f.is_file():  # writing into a FIFO waits forever
            raise BadInput(f"{f} exists and is not a regular file")
        if f.name and any(folder.is_file() for folder in f.parents):
            raise BadInput(f"{f}: a folder on its path is a file")
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out-dir {out} is a file")
    return out


def load_benchmarks(args) -> dict[str, list[Problem]]:
    """Every benchmark's problems (all data first: a typo fails before a slow model load), within
    the sample and token budgets an eval can finish."""
    benchmarks = {}
    for spec in args.benchmarks.split(","):
        named = spec in NAMED or spec in ("tiny", "tiny_train") or spec.startswith("hf:")
        name = spec if named else Path(spec).stem
        try:
            benchmarks[name] = load_problems(spec, data_dir=args.data_dir, limit=args.limit,
                                             problem_key=args.problem_key,
                                             answer_key=args.answer_key)
        except (ValueError, OSError, ImportError, TypeError) as e:
            raise BadInput(str(e)) from e
    samples = args.k * sum(map(len, benchmarks.values()))
    tokens = samples * args.max_new_tokens
    if samples > MAX_EVAL_SAMPLES or tokens > MAX_STEP_TOKENS:
        raise BadInput(f"--k {args.k} × {samples // args.k:,} problems × --max-new-tokens "
                       f"{args.max_new_tokens} = {samples:,} samples and {tokens:,} tokens, over "
                       f"{MAX_EVAL_SAMPLES:,} samples (their records alone take GBs) or "
                       f"{MAX_STEP_TOKENS:,} tokens (no eval finishes); lower --k or --limit")
    return benchmarks


def load(args, benchmarks: dict, dtype) -> tuple:
    """(model, tokenizer, end-of-completion ids, prompt ids per benchmark, notes to print once
    loaded), or BadInput. Prompts over the model's context less --max-new-tokens are dropped (and
    their problems), as in training; a template alone over it, or no prompt left, is refused."""
    try:
        model, tokenizer = load_pretrained(args.model, args.trust_remote_code, dtype)
        extra = args.stop_tokens.split(",") if args.stop_tokens else []
        stop = end_ids(tokenizer, model, args.chat_template, extra)
    except Exception as e:  # any failure to load is one line about the model
        said = oneline(e) or type(e).__name__
        raise BadInput(f"cannot load model {args.model}: {said}") from e
    broken = next((n for n, p in model.named_parameters() if not p.isfinite().all()), None)
    if broken is not None:  # its logits would be NaN: nothing to sample from
        raise BadInput(f"model {args.model}: weight {broken} is not finite (NaN or inf)")
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    limit = context - args.max_new_tokens
    frame = DataConfig(template=args.template, chat_template=args.chat_template,
                       system_prompt=args.system_prompt)
    prompts, notes = {}, []
    try:
        said = template_warnings(tokenizer, args.system_prompt) if args.chat_template else []
        notes += [f"eval.py: warning: {args.model}: its chat template {what}: the model never "
                  "sees it" for what in said]
        fault = frame_fault(tokenizer, frame, limit) if limit > 0 else None
        if fault:
            raise BadInput(f"--template (with --system-prompt and the chat template) is {fault} "
                           f"before a problem is added ({context} positions less --max-new-tokens)")
        for name, problems in benchmarks.items():
            prompts[name], benchmarks[name], dropped = build_prompts(tokenizer, problems, frame,
                                                                     limit, own_system=False)
            if not prompts[name]:
                raise BadInput(f"every problem of {name} is over {limit} tokens as a prompt (the "
                               f"model's {context} positions less --max-new-tokens)")
            if dropped:
                notes.append(f"eval.py: note: dropped {dropped} problems of {name} over {limit} "
                             "tokens")
    except ChatTemplateError as e:
        fix = "--system-prompt '' or --no-chat-template" if e.system else "--no-chat-template"
        raise BadInput(f"model {args.model}: its chat template {e.said}; pass {fix}") from e
    return model, tokenizer, stop, prompts, notes


def evaluate_checkpoint(args) -> int:
    """Evaluates args.model on every benchmark and writes the results; returns the exit code: 0,
    or 143 / 130 when SIGTERM / SIGINT cut it short (the problems finished, marked partial). The
    results folder is this eval's while it runs (support/rundir.py's results_folder)."""
    with results_folder(check_args(args)) as out:
        check_args(args)  # again, under the lock: an eval that just ended may have written them
        return evaluate_into(args, out)


def evaluate_into(args, out: Path) -> int:
    """evaluate_checkpoint's work, its results into `out`."""
    benchmarks = load_benchmarks(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer, stop, prompts, notes = load(args, benchmarks, dtype)
    sampling = RolloutConfig(group_size=args.k, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             gen_batch_size=args.batch_size)
    torch.manual_seed(args.seed)
    STOP.install()  # SIGTERM / SIGINT: the problems finished so far are written, marked partial
    model = model.to(device)
    longest = max(len(p) for ps in prompts.values() for p in ps) + args.max_new_tokens
    sampler = make_sampler(args.engine, model, tokenizer, stop, args.model, sampling, dtype,
                           longest, args.trust_remote_code, what="--engine vllm")
    if notes:  # set-up has succeeded: what it noticed
        print("\n".join(notes), file=sys.stderr)
    records, done = {}, []
    for name, problems in benchmarks.items():
        if should_stop():
            break
        records[name] = evaluate(sampler, prompts[name], [p.answer for p in problems], sampling,
                                 rewards.RewardConfig(), desc=name, keep=bool(args.save_correct),
                                 key=("eval.py", args.seed, name))
        done += problems[: len(records[name])]
        for p, r in zip(problems, records[name]):
            r["id"] = p.id
    partial = len(done) < sum(map(len, benchmarks.values()))  # (only a stop leaves problems out)
    if args.save_correct:
        finished = [r for recs in records.values() for r in recs]
        tokens = sum(t for r in finished for t in r["tokens"])
        meta = {"generated_tokens": tokens, "model": args.model, "k": args.k,
                "temperature": args.temperature, "top_p": args.top_p, "partial": partial,
                "problems": len(done)}
        n = save_correct(args.save_correct, done, finished, meta)
        print(f"wrote {n} verified-correct completions to {args.save_correct} ({tokens} tokens "
              "generated)")
    results = {name: summarize(recs) for name, recs in records.items() if recs}
    print(results_table(results, args.k))
    summary = {"args": vars(args), "partial": partial, "macro": macro(results) if results else {},
               "benchmarks": results, "problems": records}
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / "results.json", json.dumps(summary, indent=1))
    except OSError as e:
        raise BadInput(f"cannot write {out / 'results.json'}: {e.strerror or oneline(e)}") from e
    print(f"\nwrote {out / 'results.json'}")
    if not partial:
        return 0
    print(f"stopped by {signal.Signals(STOP.signum).name}: partial results, {len(done)} problems",
          file=sys.stderr)
    return 128 + STOP.signum


def save_correct(path: str, problems: list[Problem], records: list[dict], meta: dict) -> int:
    """RLEP phase I: every verified-correct completion of `records` (evaluate(keep=True)) with its
    problem, token ids and behaviour log-probs, so phase II replays exactly these tokens; `meta`
    into `<path>.meta.json`. Both written aside, then renamed: `path` holds whole lines, and a
    failed write (a full disk) leaves no file behind. Returns the number written."""
    n, tmp = 0, Path(path).with_name(f".tmp_{Path(path).name}")
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            for p, r in zip(problems, records, strict=True):
                kept = zip(r.pop("completions"), r.pop("ids"), r.pop("behav_logp"), r["correct"])
                for text, ids, logp, ok in kept:
                    if ok:
                        row = {"problem": p.problem, "completion": text, "completion_ids": ids,
                               "behav_logp": [round(x, 6) for x in logp]}
                        f.write(json.dumps(row) + "\n")
                        n += 1
        write_file(Path(path + ".meta.json"), json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise BadInput(f"cannot write {path}: {e.strerror or oneline(e)}") from e
    return n


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--compare" in argv:  # comparing runs: compare.py, with this program's name in its errors
        compare.main([a for a in argv if a != "--compare"], prog="eval.py")
        return 0
    ap = OneLineParser(prog="eval.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local checkpoint folder or Hugging Face id")
    ap.add_argument("--out-dir", help="default: <run>/eval/<model>, eval_results/<model>")
    ap.add_argument("--benchmarks", default="tiny",
                    help=f"comma list of tiny, {', '.join(NAMED)}, .jsonl/.parquet paths, hf:NAME")
    ap.add_argument("--data-dir", help="folder of the benchmark files (math500_test.jsonl, ...)")
    ap.add_argument("--problem-key", help="a custom file's problem field (problem/question/prompt)")
    ap.add_argument("--answer-key", help="a custom file's answer field (answer/solution)")
    ap.add_argument("--limit", type=int, help="first N problems of each benchmark")
    ap.add_argument("--k", type=int, default=8, help="samples per problem")
    ap.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=64, help="sequences per generate call")
    ap.add_argument("--template", default=DEFAULT_TEMPLATE, help="{problem}: the problem's text")
    ap.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    ap.add_argument("--system-prompt", default="", help="a system turn (empty = none)")
    ap.add_argument("--stop-tokens", default="", help="comma-separated extra end tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="HF generate or vLLM")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--save-correct", metavar="JSONL", help="verified-correct completions (RLEP)")
    ap.add_argument("--overwrite", action="store_true", help="replace existing results")
    ap.add_argument("--debug", action="store_true", help="bad input shows its traceback")
    args = ap.parse_args(argv)
    with command_errors("eval.py: ", args.debug, (BadInput, RunError)):  # RunError: vLLM's
        return evaluate_checkpoint(args)


if __name__ == "__main__":
    sys.exit(main())
