"""Evaluate a checkpoint on math benchmarks (`--compare`: compare training runs, see compare.py).

Usage:
  python eval.py --model data/tiny_model --benchmarks tiny --k 8 --max-new-tokens 48 --template "{problem}"
  python eval.py --model Qwen/Qwen2.5-Math-1.5B --benchmarks math500,gsm8k,aime24,aime25,amc23 \\
      --data-dir /path/to/benchmarks --k 8 --temperature 0.6 --limit 100 --out-dir eval_results/qwen1.5b
  python eval.py --compare runs/repro/none-s0 runs/repro/aper-s0 ...  # = python compare.py ...

Metrics, k samples per problem, averaged over problems ("macro" weighs every benchmark equally): avg@k (the
unbiased estimate of pass@1, with its standard error over problems), pass@k (Chen et al.'s unbiased estimator),
maj@k (the most frequent answer is right), tokens (mean response tokens), trunc (share that hit the length cap),
entropy (the sampling policy's mean token entropy). A run's model is evaluated into the run: `runs/x/final` writes
`runs/x/eval/final/results.json`, and an existing result is replaced only with --overwrite.
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
from pathlib import Path

import torch
from tqdm import tqdm

import compare
import rewards
import vllm_engine
from config import MAX_EVAL_SAMPLES, MAX_STEP_TOKENS
from data.loaders import NAMED, Problem, load_problems
from preempt import STOP, Interrupted, should_stop
from rollout import (
    ChatTemplateError,
    RolloutConfig,
    end_ids,
    generate,
    load_model,
    prompt_ids,
    template_warnings,
)

DEFAULT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples, drawn without replacement from n with c correct, is correct."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one division


def maj_at_k(answers: list[str | None], correct: list[bool]) -> float:
    """1.0 if the most frequent answer is correct. All correct samples form one vote bucket (each equals the gold);
    wrong ones vote by their text (spacing, \\dfrac and \\left/\\right normalised). Samples without an answer do not
    vote; a tie goes to the answer seen first (samples come in random order, so this favours no answer)."""
    votes = Counter(True if ok else re.sub(r"\\left|\\right|\\[!,; ]|\s|\$", "", a).replace("\\dfrac", "\\frac")
                    .replace("\\tfrac", "\\frac").rstrip(".") for a, ok in zip(answers, correct, strict=True)
                    if ok or a is not None)
    return float(bool(votes) and votes.most_common(1)[0][0] is True)  # a bool key never collides with a string


def evaluate(model, tokenizer, prompts: list[list[int]], golds: list, sampling: RolloutConfig, reward_cfg,
             stop: list[int], desc: str | None = None, keep: bool = False, engine=None,
             key: tuple = (), leave: bool = True) -> list[dict]:
    """Sample `sampling.group_size` completions per prompt (token ids) and verify them against `golds`. One record per
    prompt: correctness, extracted answers, token counts, truncation and sampling entropy per sample (and, if
    `keep`, the completions with their token ids and behaviour log-probs). A tqdm bar if `desc`
    (kept at the end if `leave`). With a vllm_engine.Engine `engine` it samples (requests seeded
    from `key`); `model` then measures entropies. A stop (preempt.should_stop) ends it within a
    token (HF generate; the engine between its calls): the records of the problems finished."""
    k, records = sampling.group_size, []
    per_call = max(1, sampling.gen_batch_size // k)  # prompts per generate call: ~gen_batch_size sequences
    starts = range(0, len(prompts), per_call)
    for start in tqdm(starts, desc=desc, disable=desc is None, leave=leave):
        chunk = prompts[start : start + per_call]
        if should_stop():
            break
        try:
            ro, texts = sample(model, tokenizer, chunk, sampling, stop, engine, (*key, start))
        except Interrupted:
            break
        gold = [g for g in golds[start : start + per_call] for _ in range(k)]
        _, correct, _ = rewards.score_batch(texts, gold, reward_cfg)
        for j in range(len(texts) // k):
            rows = range(j * k, (j + 1) * k)
            records.append({"gold": golds[start + j], "correct": [bool(correct[i]) for i in rows],
                            "answers": [rewards.extract_answer(texts[i], reward_cfg.last_number_fallback)
                                        for i in rows],
                            "tokens": ro.completion_len[rows].tolist(), "truncated": ro.truncated[rows].tolist(),
                            "entropy": ro.entropy[rows].tolist(), "sample": texts[j * k]})  # a completion to read
            if keep:
                comp = [(i, slice(int(ro.prompt_len[i]), int(ro.seq_len[i]))) for i in rows]
                records[-1] |= {"completions": [texts[i] for i in rows], "behav_logp": [ro.behav_logp[i, c].tolist()
                                for i, c in comp], "ids": [ro.tokens[i, c].tolist() for i, c in comp]}
    return records


def sample(model, tokenizer, prompts, sampling, stop, engine, key) -> tuple:
    """HF generate, or the engine (then the model measures a sampling entropy it cannot give)."""
    if engine is None:
        return generate(model, tokenizer, prompts, sampling, stop)
    ro, texts = engine.generate(tokenizer, prompts, sampling, stop, key=key)
    device = next(model.parameters()).device
    vllm_engine.fill_entropy(ro, model, sampling.temperature, device)
    return ro, texts


METRICS = ["accuracy", "pass@k", "maj@k", "response_len", "truncation_rate", "entropy"]


def summarize(records: list[dict]) -> dict[str, float]:
    """Per-problem metrics averaged over problems (accuracy's standard error over problems too); lengths and
    truncation over all samples; entropy a token mean (samples weigh by their length)."""
    acc = [sum(r["correct"]) / len(r["correct"]) for r in records]
    tokens = [t for r in records for t in r["tokens"]]
    se = statistics.stdev(acc) / len(acc) ** 0.5 if len(acc) > 1 else 0.0
    return {"accuracy": statistics.fmean(acc), "accuracy_se": se, "pass@k": statistics.fmean(
                pass_at_k(len(r["correct"]), sum(r["correct"]), len(r["correct"])) for r in records),
            "maj@k": statistics.fmean(maj_at_k(r["answers"], r["correct"]) for r in records), "response_len":
            statistics.fmean(tokens), "truncation_rate": statistics.fmean(t for r in records for t in r["truncated"]),
            "entropy": sum(e * n for r in records for e, n in zip(r["entropy"], r["tokens"])) / max(1, sum(tokens)),
            "n": len(records)}


def macro(results: dict[str, dict]) -> dict[str, float]:
    """Every benchmark weighs the same."""
    return {m: statistics.fmean(r[m] for r in results.values()) for m in METRICS} | {
        "n": sum(r["n"] for r in results.values())}


def results_table(results: dict[str, dict], k: int) -> str:
    """Markdown table, one row per benchmark plus the macro average; accuracies in percent."""
    rows = results | ({"macro": macro(results)} if len(results) > 1 else {})
    return "\n".join([f"| benchmark | problems | avg@{k} | pass@{k} | maj@{k} | tokens | trunc | entropy |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|"] + [
        f"| {name} | {r['n']} | " + " | ".join(f"{100 * r[m]:.1f}" for m in METRICS[:3])
        + f" | {r['response_len']:.1f} | {100 * r['truncation_rate']:.1f}% | {r['entropy']:.3f} |"
        for name, r in rows.items()])


# ---------------------------------------------------------------------------------------------------- CLI


class BadInput(Exception):
    """Bad input: main prints it on one line and exits 2 (with --debug, the traceback of what caused
    it)."""


def fail(msg: str) -> None:
    raise BadInput(msg)


def default_out_dir(model: str) -> Path:
    """A run's model is evaluated into that run (`runs/x/final` → `runs/x/eval/final`); others into eval_results/."""
    path = Path(model).expanduser()
    run = next((p for p in (path.parent, path.parent.parent) if (p / ".run").is_file()), None)
    return run / "eval" / "_".join(path.relative_to(run).parts) if run else Path("eval_results") / path.name


def check_args(args) -> Path:
    """Refuse bad arguments and outputs that exist (or are not regular files) before anything loads;
    returns the output folder."""
    for ok, msg in [(args.k >= 1, f"--k must be ≥ 1, got {args.k}"),
                    (args.limit is None or args.limit >= 1, "--limit must be ≥ 1"),
                    (args.max_new_tokens >= 1, f"--max-new-tokens must be ≥ 1, got {args.max_new_tokens}"),
                    (args.batch_size >= 1, f"--batch-size must be ≥ 1, got {args.batch_size}"),
                    (args.temperature >= 0, f"--temperature must be ≥ 0, got {args.temperature}"),
                    (0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}"),
                    ("{problem}" in args.template, "--template must contain {problem}"),
                    (0 <= args.seed < 2**32, f"--seed must be in [0, 2^32), got {args.seed}")]:
        if not ok:
            fail(msg)
    out = Path(args.out_dir) if args.out_dir else default_out_dir(args.model)
    for f in (out / "results.json", Path(args.save_correct or "")) if not args.overwrite else ():
        if f.is_file():
            fail(f"{f} exists; pass --overwrite to replace it or --out-dir to write elsewhere")
    for f in (out / "results.json", Path(args.save_correct or "")):
        if f.name and f.exists() and not f.is_file():  # writing into a FIFO waits forever
            fail(f"{f} exists and is not a regular file")
    if out.exists() and not out.is_dir():
        fail(f"--out-dir {out} is a file")
    return out


def load_benchmarks(args) -> dict[str, list[Problem]]:
    """Every benchmark's problems (all data first: a typo fails before a slow model load),
    within the sample and token budgets an eval can finish."""
    benchmarks = {}
    for spec in args.benchmarks.split(","):
        try:
            named = spec in NAMED or spec in ("tiny", "tiny_train") or spec.startswith("hf:")
            name = spec if named else Path(spec).stem
            benchmarks[name] = load_problems(spec, data_dir=args.data_dir, problem_key=args.problem_key,
                                             answer_key=args.answer_key, limit=args.limit)
        except (ValueError, OSError, ImportError, TypeError) as e:
            fail(str(e))
    samples = args.k * sum(map(len, benchmarks.values()))
    if samples > MAX_EVAL_SAMPLES or samples * args.max_new_tokens > MAX_STEP_TOKENS:
        tokens = samples * args.max_new_tokens
        fail(f"--k {args.k} × {samples // args.k:,} problems × --max-new-tokens "
             f"{args.max_new_tokens} = {samples:,} samples and {tokens:,} tokens, over "
             f"{MAX_EVAL_SAMPLES:,} samples (their records alone take GBs) or {MAX_STEP_TOKENS:,} "
             "tokens (no eval finishes); lower --k or --limit")
    return benchmarks


def run_eval(args) -> int:
    """Evaluate args.model; returns the exit code: 0, or 143 / 130 when SIGTERM / SIGINT cut it
    short (the problems finished are written, marked partial)."""
    out = check_args(args)
    benchmarks = load_benchmarks(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model, tokenizer = load_model(args.model, args.trust_remote_code, dtype)
        stop = end_ids(tokenizer, model, args.chat_template, args.stop_tokens.split(",") if args.stop_tokens else [])
    except Exception as e:  # noqa: BLE001 -- any failure to load is one line about the model
        fail(f"cannot load model {args.model}: {' '.join(str(e).split())[:300] or type(e).__name__}")
    sampling = RolloutConfig(group_size=args.k, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, gen_batch_size=args.batch_size)
    torch.manual_seed(args.seed)
    prompts = {}
    said = template_warnings(tokenizer, args.system_prompt) if args.chat_template else []
    for what in said:
        print(f"eval.py: warning: {args.model}: its chat template {what}: the model never sees it",
              file=sys.stderr)
    for name, problems in benchmarks.items():
        prompts[name] = [prompt_ids(tokenizer, p.problem, args.template, args.chat_template,
                                    args.system_prompt) for p in problems]
    engine = make_engine(args, sampling, dtype, device, prompts)
    STOP.install()  # SIGTERM / SIGINT: the problems finished so far are written, marked partial
    records, done = run_benchmarks(args, benchmarks, prompts, sampling, model.to(device), tokenizer,
                                   stop, engine)
    results = {name: summarize(recs) for name, recs in records.items() if recs}
    partial = len(done) < sum(map(len, benchmarks.values()))  # (only a stop leaves problems out)
    if args.save_correct:
        tokens = sum(t for recs in records.values() for r in recs for t in r["tokens"])
        meta = {"generated_tokens": tokens, "model": args.model, "k": args.k, "temperature": args.temperature,
                "top_p": args.top_p, "partial": partial, "problems": len(done)}
        finished = [r for recs in records.values() for r in recs]
        n = save_correct(args.save_correct, done, finished, meta)
        print(f"wrote {n} verified-correct completions to {args.save_correct} ({tokens} tokens generated)")
    print(results_table(results, args.k))
    try:
        out.mkdir(parents=True, exist_ok=True)
        overall = macro(results) if results else {}
        summary = {"args": vars(args), "partial": partial, "macro": overall, "benchmarks": results,
                   "problems": records}
        (out / "results.json").write_text(json.dumps(summary, indent=1))
    except OSError as e:
        fail(f"cannot write {out / 'results.json'}: {e.strerror}")
    print(f"\nwrote {out / 'results.json'}")
    if partial:
        name = signal.Signals(STOP.signum).name
        print(f"stopped by {name}: partial results, {len(done)} problems", file=sys.stderr)
        return 128 + STOP.signum
    return 0


def run_benchmarks(args, benchmarks: dict, prompts: dict, sampling: RolloutConfig, model, tokenizer,
                   stop: list[int], engine) -> tuple[dict, list]:
    """(records per benchmark, the problems they are of) until every problem is done or a stop."""
    records, done = {}, []
    for name, problems in benchmarks.items():
        if should_stop():
            break
        golds = [p.answer for p in problems]
        records[name] = evaluate(model, tokenizer, prompts[name], golds, sampling,
                                 rewards.RewardConfig(), stop, desc=name,
                                 keep=bool(args.save_correct), engine=engine,
                                 key=("eval.py", args.seed, name))
        done += problems[: len(records[name])]
        for p, r in zip(problems, records[name]):
            r.update(id=p.id)
    return records, done


def make_engine(args, sampling: RolloutConfig, dtype, device: str, prompts: dict):
    """--engine vllm: an engine on --model, long enough for every prompt and --max-new-tokens."""
    if args.engine == "hf":
        return None
    if not vllm_engine.available():
        fail("--engine vllm needs vLLM (pip install -r requirements-vllm.txt)")
    longest = max(len(p) for ps in prompts.values() for p in ps) + args.max_new_tokens
    try:
        return vllm_engine.Engine(args.model, sampling, dtype, torch.device(device), longest,
                                  args.trust_remote_code)
    except (ValueError, RuntimeError, OSError) as e:
        fail(f"--engine vllm: {type(e).__name__}: {' '.join(str(e).split())[:300]}")


def save_correct(path: str, problems: list[Problem], records: list[dict], meta: dict) -> int:
    """RLEP phase I: every verified-correct completion of `records` (evaluate(keep=True)) with its problem text, token
    ids and behaviour log-probs, so phase II replays exactly these tokens; `<path>.meta.json` gets `meta` (the tokens
    this sampling generated among it). Returns the number of completions written. The file is
    written aside and renamed into place: whatever stops the process, `path` holds whole lines."""
    n, tmp = 0, Path(path).with_name(f".tmp_{Path(path).name}")
    with open(tmp, "w") as f:
        for p, r in zip(problems, records, strict=True):
            for text, ids, lp, ok in zip(r.pop("completions"), r.pop("ids"), r.pop("behav_logp"), r["correct"]):
                if ok:
                    f.write(json.dumps({"problem": p.problem, "completion": text, "completion_ids": ids,
                                        "behav_logp": [round(x, 6) for x in lp]}) + "\n")
                    n += 1
    os.replace(tmp, path)
    Path(path + ".meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return n


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--compare" in argv:  # comparing runs: compare.py, with this program's name in its errors
        compare.main([a for a in argv if a != "--compare"], prog="eval.py")
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model", help="local checkpoint folder or Hugging Face model id")
    mode.add_argument("--compare", nargs="+", metavar="RUN_DIR",
                      help="compare training runs instead (python compare.py --help)")
    ap.add_argument("--out-dir", help="where results go (default: <run>/eval/<model>, "
                    "eval_results/<model>)")
    g = ap.add_argument_group("evaluating a model")
    g.add_argument("--benchmarks", default="tiny", help=f"comma list of tiny, {', '.join(NAMED)}, .jsonl/.parquet "
                   "paths, hf:NAME")
    g.add_argument("--data-dir", help="folder holding the benchmark files (math500_test.jsonl, ...)")
    g.add_argument("--problem-key", help="problem field of a custom file (default: problem/question/prompt)")
    g.add_argument("--answer-key", help="answer field of a custom file (default: answer/solution)")
    g.add_argument("--limit", type=int, help="first N problems of each benchmark")
    g.add_argument("--k", type=int, default=8, help="samples per problem")
    g.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--max-new-tokens", type=int, default=1024)
    g.add_argument("--batch-size", type=int, default=64, help="sequences per generate call")
    g.add_argument("--template", default=DEFAULT_TEMPLATE, help="instruction text, {problem} replaced by the problem")
    g.add_argument("--no-chat-template", dest="chat_template", action="store_false", help="plain prompts")
    g.add_argument("--system-prompt", default="", help="system turn of the chat template (empty = none)")
    g.add_argument("--stop-tokens", default="", help="comma-separated extra end tokens")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="what samples: HF generate or vLLM (requirements-vllm.txt)")
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--save-correct", metavar="JSONL", help="write every verified-correct completion (RLEP phase I)")
    g.add_argument("--overwrite", action="store_true", help="replace existing results")
    ap.add_argument("--debug", action="store_true", help="bad input shows its traceback")
    args = ap.parse_args(argv)
    try:
        return run_eval(args)
    except ChatTemplateError as e:
        fix = "--system-prompt '' or --no-chat-template" if e.system else "--no-chat-template"
        bad = BadInput(f"model {args.model}: its chat template {e.said}; pass {fix}")
        error_exit(bad, args.debug)
    except BadInput as e:
        error_exit(e, args.debug)


def error_exit(e: BadInput, debug: bool) -> None:
    """One line and exit 2; with --debug, the traceback of `e` and of the exception it replaced."""
    if debug:
        raise e
    print(f"eval.py: error: {e}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    sys.exit(main())
