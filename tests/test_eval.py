"""eval.py: metric estimators against brute force and hand-computed values, `evaluate` on scripted
completions, `--compare` on synthetic run folders, and the `--model` CLI end to end on a tiny random model."""

import csv
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoTokenizer

import eval as ev
from rollout import RolloutConfig, pack

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(os.environ.get("SHARED_DATA_DIR", ROOT.parent / "shared" / "data")) / "benchmarks"

# ---------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 are the correct ones
            brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
            assert ev.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    assert ev.pass_at_k(8, 0, 8) == 0.0
    assert ev.pass_at_k(8, 1, 8) == 1.0
    assert ev.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain accuracy
    assert ev.avg_at_k([True, False, False, True]) == 0.5


def test_maj_at_k_hand_examples():
    assert ev.maj_at_k(["4", "4", "5"], [True, True, False]) == 1.0
    assert ev.maj_at_k(["5", "5", "4"], [False, False, True]) == 0.0
    # correct answers written differently still vote together: 2 correct beat 1 wrong
    assert ev.maj_at_k(["1/2", "0.5", "3"], [True, True, False]) == 1.0
    # wrong answers that differ only in spacing/\dfrac vote together: 2 wrong beat 1 correct
    assert ev.maj_at_k(["\\dfrac{1}{3}", "\\frac{1}{3} ", "\\frac12"], [False, False, True]) == 0.0
    # samples without an answer do not vote
    assert ev.maj_at_k([None, None, "7"], [False, False, True]) == 1.0
    assert ev.maj_at_k([None, None], [False, False]) == 0.0
    # a tie goes to the answer seen first
    assert ev.maj_at_k(["7", "8"], [True, False]) == 1.0
    assert ev.maj_at_k(["8", "7"], [False, True]) == 0.0


def test_aes_hand_values():
    # ΔL = (1000 - 800) / 1000 = 0.2; ΔA = (0.55 - 0.5) / 0.5 = 0.1 -> 0.2 + 3 * 0.1
    assert ev.aes(800, 0.55, 1000, 0.5) == pytest.approx(0.5)
    # ΔA = -0.1 -> 0.2 - 5 * 0.1
    assert ev.aes(800, 0.45, 1000, 0.5) == pytest.approx(-0.3)
    # longer and equally accurate: ΔL = -0.5, ΔA = 0
    assert ev.aes(1500, 0.5, 1000, 0.5) == pytest.approx(-0.5)
    assert ev.aes(800, 0.45, 1000, 0.5, alpha=2, beta=5, gamma=10) == pytest.approx(2 * 0.2 - 10 * 0.1)
    assert math.isnan(ev.aes(800, 0.5, 1000, 0.0))


# ---------------------------------------------------------------------------------------------- evaluate


def test_evaluate_on_scripted_completions(monkeypatch):
    rewards = pytest.importorskip("rewards")
    script = {1: ["\\boxed{1}", "\\boxed{1}"], 2: ["\\boxed{3}", "\\boxed{4}"], 3: ["\\boxed{5}", "no idea"]}

    def fake_generate(model, tokenizer, prompts, sampling, stop, *args):
        texts = [t for p in prompts for t in script[p[0]][: sampling.group_size]]
        n = torch.tensor([len(t) for t in texts])
        return SimpleNamespace(completion_len=n, truncated=torch.tensor([t == "no idea" for t in texts]),
                               entropy=n / 10), texts

    monkeypatch.setattr(ev, "generate", fake_generate)
    sampling = RolloutConfig(group_size=2, max_new_tokens=9, gen_batch_size=2)
    records = ev.evaluate(None, None, [[1], [2], [3]], ["1", "4", "9"], sampling, rewards.RewardConfig(), [0])
    assert [r["correct"] for r in records] == [[True, True], [False, True], [False, False]]
    assert [r["answers"] for r in records] == [["1", "1"], ["3", "4"], ["5", None]]
    r = ev.summarize(records)  # flat scalars, as train.py logs them
    assert r["n"] == 3 and all(isinstance(v, float | int) for v in r.values())
    assert r["accuracy"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert r["pass@k"] == pytest.approx(2 / 3)
    assert r["maj@k"] == pytest.approx(1 / 3)  # p2 ties 3 vs 4 and "3" came first
    assert r["response_len"] == pytest.approx((9 * 5 + 7) / 6)
    assert r["truncation_rate"] == pytest.approx(1 / 6)
    assert r["entropy"] == pytest.approx((9 * 5 * 0.9 + 7 * 0.7) / (9 * 5 + 7))  # a token mean: rows weigh by length


# ---------------------------------------------------------------------------------------------- --compare


def write_run(root: Path, strategy: str, seed: int, evals: list[tuple[int, float, float]], finished: bool = True) -> Path:
    """A run folder like train.py writes; evals are (generated tokens, eval accuracy, eval response length)."""
    d = root / f"{strategy}-s{seed}"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "replay": {"strategy": strategy}}))
    with open(d / "metrics.jsonl", "w") as f:
        for step, (tokens, acc, length) in enumerate(evals):
            rec = {"step": step, "generated_tokens": tokens, "reward_mean": acc, "entropy": 0.5 + step,
                   "response_len": length, "wall_seconds": 10.0 * step, "eval/accuracy": acc, "eval/response_len": length}
            f.write(json.dumps(rec) + "\n")
    if finished:
        tokens, acc, length = evals[-1]
        (d / "summary.json").write_text(json.dumps({
            "eval_accuracy_initial": evals[0][1], "eval_accuracy_final": acc, "eval_response_len_final": length,
            "generated_tokens": tokens, "steps": len(evals), "wall_seconds": 100.0 + seed, "entropy_final": 0.25,
            "strategy": strategy, "seed": seed}))
    return d


def test_compare_on_synthetic_runs(tmp_path, capsys):
    runs = [
        write_run(tmp_path, "none", 0, [(0, 0.2, 100), (1000, 0.4, 100), (2000, 0.5, 100)]),
        write_run(tmp_path, "none", 1, [(0, 0.2, 120), (1000, 0.55, 120), (2000, 0.6, 120)]),
        write_run(tmp_path, "fifo", 0, [(0, 0.2, 88), (500, 0.55, 88), (1000, 0.6, 88)]),
        write_run(tmp_path, "fifo", 1, [(0, 0.2, 88), (500, 0.58, 88), (1000, 0.6, 88)]),
        write_run(tmp_path, "aper", 0, [(0, 0.2, 110), (700, 0.44, 110)], finished=False),  # crashed: no summary
    ]
    out = tmp_path / "out"
    ev.main(["--compare", *map(str, runs), "--out-dir", str(out)])
    table = capsys.readouterr().out
    with open(out / "compare.csv") as f:
        rows = {(r["strategy"], r["seed"]): r for r in csv.DictReader(f)}

    # target = none's final mean 0.55; baseline length 110, tokens 2000; none's mean curve peaks at 0.55 at step 2
    assert rows["none", "0"]["tokens_to_target"] == "" and rows["none", "1"]["tokens_to_target"] == "1000"
    assert rows["fifo", "0"]["tokens_to_target"] == "500" and float(rows["fifo", "0"]["tokens_ratio"]) == 0.25
    assert rows["fifo", "1"]["steps_to_peak"] == "1" and float(rows["fifo", "1"]["steps_ratio"]) == 0.5
    assert rows["aper", "0"]["steps_to_peak"] == "" and rows["aper", "0"]["tokens_ratio"] == ""
    # fifo: ΔL = (110 - 88) / 110 = 0.2, ΔA = (0.6 - 0.55) / 0.55 -> 0.2 + 3 ΔA
    assert float(rows["fifo", "1"]["aes"]) == pytest.approx(0.2 + 3 * 0.05 / 0.55)
    # aper (from metrics.jsonl, strategy from config.yaml): ΔL = 0, ΔA = -0.2 -> -5 * 0.2
    assert float(rows["aper", "0"]["aes"]) == pytest.approx(-1.0)
    assert float(rows["aper", "0"]["entropy_final"]) == 1.5 and float(rows["aper", "0"]["wall_seconds"]) == 10.0

    lines = table.splitlines()
    assert "tokens to 55.0% ÷ none tokens" in lines[0] and "steps to 55.0% ÷ none's" in lines[0]
    # baseline first; a seed that never reaches counts as slowest, so none's median of (0.5, never) is "not reached"
    assert lines[2].startswith("| none | 2 | 55.0 ± 7.1 | not reached (1/2) | not reached (1/2) |")
    assert any(line.startswith("| fifo | 2 | 60.0 ± 0.0 | 0.25 (2/2) | 0.50 (2/2) |") for line in lines)
    assert any(line.startswith("| aper | 1 | 44.0 | not reached (0/1) | not reached (0/1) |") for line in lines)
    assert (out / "compare.png").exists() or "matplotlib is not installed" in table


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem": "1+1", "answer": "2"}))
    for argv in (["--compare", str(tmp_path / "no_such_run")],
                 ["--model", str(tmp_path / "no_such_model"), "--benchmarks", str(problems)],
                 ["--model", str(tmp_path), "--benchmarks", str(problems)],  # a folder without config.json
                 ["--model", str(tmp_path), "--benchmarks", "math5000", "--data-dir", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            ev.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("eval.py: error:") and "\n" not in err


# ---------------------------------------------------------------------------------------------- --model end to end


@pytest.fixture(scope="module")
def tiny_random_model(tmp_path_factory) -> Path:
    """A randomly initialised 1-layer Qwen2 with a character-level tokenizer and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny_random_model")
    chars = sorted(set("0123456789+-*/=()^.,:;?!$\\{}_ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"))
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def test_cli_model_end_to_end(tiny_random_model, tmp_path):
    pytest.importorskip("rewards")
    custom = tmp_path / "custom.jsonl"
    custom.write_text(json.dumps({"question": "What is 1+1?", "answer": "2"}) + "\n" + json.dumps({"question": "2*3?", "answer": "6"}))
    benchmarks = [str(custom)] + (["amc23"] if BENCH.is_dir() else [])
    out = tmp_path / "out"
    cmd = [sys.executable, "eval.py", "--model", str(tiny_random_model), "--benchmarks", ",".join(benchmarks),
           "--data-dir", str(BENCH), "--limit", "2", "--k", "2", "--max-new-tokens", "6", "--batch-size", "4",
           "--out-dir", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| benchmark | problems | avg@2 | pass@2 | maj@2 | tokens | trunc |" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert list(results["benchmarks"]) == ["custom"] + (["amc23"] if BENCH.is_dir() else [])
    for name, r in results["benchmarks"].items():
        assert r["n"] == 2 and len(results["problems"][name][0]["correct"]) == 2
        assert 0 < r["response_len"] <= 6 and 0 <= r["truncation_rate"] <= 1
    assert set(results["macro"]) == set(ev.METRICS)


def test_save_correct_writes_only_verified_completions(tiny_random_model, tmp_path, monkeypatch):
    """RLEP phase I: `--save-correct` keeps exactly the verified-correct samples with their token ids and behaviour
    log-probs, and writes the tokens phase I generated beside them."""
    custom = tmp_path / "custom.jsonl"
    custom.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n" + json.dumps({"question": "2*3", "answer": "6"}) + "\n")
    script = {"1+1": ["\\boxed{2}", "\\boxed{3}"], "2*3": ["\\boxed{5}", "so \\boxed{6}"]}

    def fake_generate(model, tokenizer, prompts, sampling, stop, *args):
        rows, texts = [], []
        for p in prompts:
            for t in next(v for q, v in script.items() if q in tokenizer.decode(p)):  # prompts carry the chat template
                ids = tokenizer(t, add_special_tokens=False)["input_ids"]
                rows.append((p + ids, len(p), [-0.5] * len(ids), False, 1.0))
                texts.append(t)
        n = len(rows)
        return pack(rows, tokenizer.pad_token_id, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), 0), texts

    monkeypatch.setattr(ev, "generate", fake_generate)
    saved = tmp_path / "phase1.jsonl"
    ev.main(["--model", str(tiny_random_model), "--benchmarks", str(custom), "--k", "2", "--template", "{problem}",
             "--out-dir", str(tmp_path / "out"), "--save-correct", str(saved)])
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tiny_random_model)
    assert [(r["problem"], r["completion"]) for r in rows] == [("1+1", "\\boxed{2}"), ("2*3", "so \\boxed{6}")]
    for r in rows:
        assert r["completion_ids"] == tok(r["completion"], add_special_tokens=False)["input_ids"]
        assert r["behav_logp"] == [-0.5] * len(r["completion_ids"])
    meta = json.loads(saved.with_name("phase1.jsonl.meta.json").read_text())
    assert meta["generated_tokens"] == sum(len(tok(t, add_special_tokens=False)["input_ids"]) for v in script.values() for t in v)
    assert "completions" not in json.loads((tmp_path / "out" / "results.json").read_text())["problems"]["custom"][0]


