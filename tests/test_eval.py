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
    assert ev.summarize([{"correct": [True, False, False, True], "answers": ["1"] * 4, "tokens": [1] * 4, "truncated": [False] * 4, "entropy": [0.0] * 4}])["accuracy"] == 0.5


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


def write_run(root: Path, strategy: str, seed: int, evals: list[tuple], finished: bool = True, rounds: int = 0) -> Path:
    """A run folder like train.py writes; evals are (generated tokens, eval accuracy, eval response length[, se])."""
    d = root / f"{strategy}-s{seed}{'-dyn' if rounds else ''}"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "replay": {"strategy": strategy},
                                                   "rollout": {"dynamic_sampling": rounds}}))
    with open(d / "metrics.jsonl", "w") as f:
        for step, (tokens, acc, length, *se) in enumerate(evals):
            rec = {"step": step, "generated_tokens": tokens, "tokens/generated_total": tokens, "eval/accuracy": acc,
                   "eval/accuracy_se": se[0] if se else 0.0, "eval/response_len": length, "eval/entropy": 0.5 + step}
            f.write(json.dumps(rec) + "\n")
    if finished:
        tokens, acc, length, *_ = evals[-1]
        (d / "summary.json").write_text(json.dumps({
            "eval_accuracy_initial": evals[0][1], "eval_accuracy_final": acc, "eval_response_len_final": length,
            "tokens_generated_total": tokens, "steps": len(evals), "eval_entropy_final": 0.25, "strategy": strategy,
            "seed": seed}))
    return d


def test_phase_one_tokens_come_before_the_first_update(tmp_path):
    """RLEP's phase-I generation is spent before step 1: the initial eval sits at those tokens, not at 0."""
    d = write_run(tmp_path, "rlep", 0, [(0, 0.2, 100), (1000, 0.6, 100)])
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["tokens/generated_total"] = r["generated_tokens"] + 5000
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"strategy": "rlep", "eval_accuracy_initial": 0.2,
                                                "tokens_generated_total": 6000}))
    run = ev.load_run(d)
    assert [c[1] for c in run["curve"]] == [5000, 5000, 6000] and run["tokens"] == 6000
    assert ev.sustained_crossing(run["curve"], 0.4) == pytest.approx(5500)


def test_sustained_crossing_hand_values():
    curve = [(0, 0, 0.2, 0.01), (1, 100, 0.4, 0.01), (2, 200, 0.6, 0.01), (3, 300, 0.45, 0.01), (4, 400, 0.7, 0.01)]
    # 0.6 at 200 touches 0.5 but falls back to 0.45 < 0.5 - 0.01: only the last rise counts, interpolated 300 → 400
    assert ev.sustained_crossing(curve, 0.5) == pytest.approx(300 + 0.05 / 0.25 * 100)
    wide = [c[:3] + (0.06,) for c in curve]  # within one standard error (0.45 ≥ 0.44): the first crossing stands
    assert ev.sustained_crossing(wide, 0.5) == pytest.approx(100 + 0.1 / 0.2 * 100)
    assert ev.sustained_crossing(curve, 0.8) is None  # never reached
    assert ev.sustained_crossing(curve[:4], 0.5) is None  # touched once, ended below: no crossing
    assert ev.sustained_crossing([(0, 0, 0.5, 0.0)], 0.5) == 0
    assert ev.unreached(0.0) == 0 and ev.unreached(None) == math.inf  # reached at the start is not "never"


def test_bootstrap_t_interval_and_welch_hand_values():
    # Every resample of (1, 2): medians 1, 1.5, 1.5, 2; linear percentiles at 2.5 % and 97.5 % of those four
    assert ev.bootstrap([1.0, 2.0]) == pytest.approx((1 + 0.075 * 0.5, 1.5 + 0.925 * 0.5))
    assert ev.bootstrap([1.0, math.inf, math.inf])[1] == math.inf  # seeds that never reach stay infinitely slow
    # t interval of (1, 2, 3): 2 ± t(0.975, 2 dof) / √3, and for 2 dof t_p = (2p − 1) / √(2p(1 − p))
    t2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert ev.mean_interval([1.0, 2.0, 3.0]) == pytest.approx((2 - t2 / math.sqrt(3), 2 + t2 / math.sqrt(3)), rel=1e-6)
    # Welch, (1, 2, 3) vs (4, 5, 6): t = 3 / √(2/3) with 4 dof, where P(|T| > t) = 1 − x(3 − x²)/2, x = t / √(t² + 4)
    t = 3 / math.sqrt(2 / 3)
    x = t / math.sqrt(t * t + 4)
    assert ev.welch_p([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == pytest.approx(1 - x * (3 - x * x) / 2, rel=1e-9)
    assert ev.welch_p([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == pytest.approx(1.0)


def test_compare_on_synthetic_runs(tmp_path, capsys):
    runs = [
        write_run(tmp_path, "none", 0, [(0, 0.2, 100), (1000, 0.4, 100), (2000, 0.5, 100)]),
        write_run(tmp_path, "none", 1, [(0, 0.2, 120), (1000, 0.55, 120), (2000, 0.6, 120)]),
        write_run(tmp_path, "fifo", 0, [(0, 0.2, 88), (500, 0.55, 88), (1000, 0.6, 88)]),
        write_run(tmp_path, "fifo", 1, [(0, 0.2, 88), (500, 0.6, 88), (1000, 0.5, 88, 0.1)]),  # falls back, within 1 se
        write_run(tmp_path, "aper", 0, [(0, 0.2, 110), (700, 0.6, 110), (900, 0.44, 110)], finished=False),  # no summary
        write_run(tmp_path, "none", 0, [(0, 0.2, 100), (3000, 0.9, 100)], rounds=4),  # dynamic sampling: not a baseline
    ]
    out = tmp_path / "out"
    ev.main(["--compare", *map(str, runs), "--out-dir", str(out)])
    table = capsys.readouterr().out
    with open(out / "compare.csv") as f:
        rows = {(r["strategy"], r["seed"]): r for r in csv.DictReader(f)}
    # target = none's final mean 0.55; its mean length 110 and tokens 2000
    assert rows["none", "0"]["tokens_to_target"] == "" and float(rows["none", "1"]["tokens_to_target"]) == 1000
    assert float(rows["fifo", "0"]["tokens_to_target"]) == 500 and float(rows["fifo", "0"]["tokens_ratio"]) == 0.25
    assert float(rows["fifo", "1"]["tokens_to_target"]) == pytest.approx(0.35 / 0.4 * 500)  # 0.2 → 0.6 crosses 0.55 there
    assert rows["aper", "0"]["tokens_ratio"] == ""  # reached 0.6, then fell to 0.44 < 0.55: not sustained
    assert float(rows["fifo", "0"]["aes"]) == pytest.approx(0.2 + 3 * 0.05 / 0.55)  # ΔL = 22/110, ΔA = 0.05/0.55
    assert float(rows["aper", "0"]["aes"]) == pytest.approx(-5 * (0.55 - 0.44) / 0.55)  # from metrics.jsonl
    summary = {s["strategy"]: s for s in json.loads((out / "compare.json").read_text())["strategies"]}
    assert summary["dynamic"]["seeds"] == 1 and summary["none"]["seeds"] == 2  # 0.2 → 0.9 crosses 0.55 at 1500
    assert float(rows["dynamic", "0"]["tokens_ratio"]) == pytest.approx(1500 / 2000)
    # steps: none's seed-mean curve (0, 0.2), (1, 0.475), (2, 0.55) crosses 0.55 at step 2; fifo at 1 and 0.875
    assert float(rows["fifo", "0"]["steps_to_target"]) == 1 and float(rows["fifo", "1"]["steps_to_target"]) == pytest.approx(0.875)
    assert summary["fifo"]["steps_ratio"] == pytest.approx((0.5 + 0.4375) / 2) and summary["none"]["steps_ratio"] == math.inf
    assert summary["fifo"]["ratio_median"] == pytest.approx((0.25 + 0.21875) / 2) and summary["fifo"]["reached"] == 2
    assert summary["none"]["reached"] == 1 and summary["fifo"]["p_vs_base"] == pytest.approx(ev.welch_p([0.6, 0.5], [0.5, 0.6]))
    lines = table.splitlines()
    assert "tokens to 55.0% ÷ none's" in lines[0] and lines[2].startswith("| none | 2 |")  # the baseline first
    assert any(ln.startswith("| aper | 1 | 44.0 (nan–nan) |  | never reached") for ln in lines)


def test_compare_arms_named_by_hand(tmp_path, capsys):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    base = write_run(tmp_path / "a", "none", 0, [(0, 0.2, 100), (1000, 0.5, 100)])
    half = write_run(tmp_path / "b", "none", 0, [(0, 0.2, 100), (500, 0.6, 100)])
    ev.main(["--compare", str(base), f"none_half={half}", "--out-dir", str(tmp_path / "out")])
    summary = {s["strategy"]: s for s in json.loads((tmp_path / "out" / "compare.json").read_text())["strategies"]}
    assert set(summary) == {"none", "none_half"} and summary["none"]["acc_mean"] == 0.5  # the baseline is run a alone
    assert summary["none_half"]["ratio_median"] == pytest.approx(0.3 / 0.4 * 500 / 1000)


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
    assert "| benchmark | problems | avg@2 | pass@2 | maj@2 | tokens | trunc | entropy |" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert list(results["benchmarks"]) == ["custom"] + (["amc23"] if BENCH.is_dir() else [])
    for name, r in results["benchmarks"].items():
        assert r["n"] == 2 and len(results["problems"][name][0]["correct"]) == 2
        assert 0 < r["response_len"] <= 6 and 0 <= r["truncation_rate"] <= 1
    assert set(results["macro"]) == {*ev.METRICS, "n"}


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




def test_plateau_check_on_hand_made_curves(tmp_path):
    """bench/plateau.py: last three evals within one SE of the seed-mean -> exit 0; a rising tail -> exit 1."""
    def run(name, accs):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": 5 * i, "generated_tokens": 1000 * i, "eval/accuracy": a, "eval/accuracy_se": 0.02}
                for i, a in enumerate(accs)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "config.yaml").write_text("replay:\n  strategy: none\n")
        return str(d)

    script = [sys.executable, str(ROOT / "bench" / "plateau.py")]
    # seed means 0.50, 0.51, 0.505 at the last three evals: spread 0.01 <= SE 0.02 / sqrt(2)
    flat = subprocess.run([*script, run("a", [0.2, 0.5, 0.52, 0.50]), run("b", [0.2, 0.5, 0.50, 0.51])],
                          check=False, capture_output=True, text=True)
    assert flat.returncode == 0 and "-> plateaued" in flat.stdout
    # seed means 0.45, 0.50, 0.55: spread 0.10 > 0.014
    rising = subprocess.run([*script, run("c", [0.2, 0.45, 0.5, 0.55]), run("d", [0.2, 0.45, 0.5, 0.55])],
                            check=False, capture_output=True, text=True)
    assert rising.returncode == 1 and "still moving" in rising.stdout
