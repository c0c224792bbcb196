"""eval.py: metric estimators against brute force and hand-computed values, `evaluate` on scripted
completions, and the `--model` CLI end to end on a tiny random model (`--compare`:
test_compare.py)."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

import eval as ev
import rollout
from batch import Row, pack
from rollout import HFSampler, RolloutConfig

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
BENCH = Path(os.environ.get("SHARED_DATA_DIR", REPO.parent / "shared" / "data")) / "benchmarks"

# ----------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            # samples 0..c-1 are the correct ones
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
            assert ev.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    assert ev.pass_at_k(8, 0, 8) == 0.0
    assert ev.pass_at_k(8, 1, 8) == 1.0
    assert ev.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain accuracy
    assert ev.summarize([{"correct": [True, False, False, True], "answers": ["1"] * 4,
                          "tokens": [1] * 4, "truncated": [False] * 4,
                          "entropy": [0.0] * 4}])["accuracy"] == 0.5


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


# ---------------------------------------------------------------------------------------- evaluate


def test_evaluate_on_scripted_completions(monkeypatch):
    rewards = pytest.importorskip("rewards")
    script = {1: ["\\boxed{1}", "\\boxed{1}"], 2: ["\\boxed{3}", "\\boxed{4}"],
              3: ["\\boxed{5}", "no idea"]}

    def fake_generate(model, tokenizer, prompts, sampling, stop, *args):
        texts = [t for p in prompts for t in script[p[0]][: sampling.group_size]]
        n = torch.tensor([len(t) for t in texts])
        return SimpleNamespace(completion_len=n,
                               truncated=torch.tensor([t == "no idea" for t in texts]),
                               entropy=n / 10), texts

    monkeypatch.setattr(rollout, "generate", fake_generate)  # what HFSampler samples with
    sampling = RolloutConfig(group_size=2, max_new_tokens=9, gen_batch_size=2)
    sampler = HFSampler(None, None, [0])
    records = ev.evaluate(sampler, [[1], [2], [3]], ["1", "4", "9"], sampling,
                          rewards.RewardConfig())
    assert [r["correct"] for r in records] == [[True, True], [False, True], [False, False]]
    assert [r["answers"] for r in records] == [["1", "1"], ["3", "4"], ["5", None]]
    r = ev.summarize(records)  # flat scalars, as train.py logs them
    assert r["n"] == 3 and all(isinstance(v, float | int) for v in r.values())
    assert r["accuracy"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert r["pass@k"] == pytest.approx(2 / 3)
    assert r["maj@k"] == pytest.approx(1 / 3)  # p2 ties 3 vs 4 and "3" came first
    assert r["response_len"] == pytest.approx((9 * 5 + 7) / 6)
    assert r["truncation_rate"] == pytest.approx(1 / 6)
    # a token mean: rows weigh by length
    assert r["entropy"] == pytest.approx((9 * 5 * 0.9 + 7 * 0.7) / (9 * 5 + 7))


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem": "1+1", "answer": "2"}))
    for argv in (["--compare", str(tmp_path / "no_such_run")],
                 ["--model", str(tmp_path / "no_such_model"), "--benchmarks", str(problems)],
                 # a folder without config.json
                 ["--model", str(tmp_path), "--benchmarks", str(problems)],
                 ["--model", str(tmp_path), "--benchmarks", "math5000", "--data-dir",
                  str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            ev.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("eval.py: error:") and "\n" not in err


# ------------------------------------------------------------------------------ --model end to end


@pytest.fixture(scope="module")
def tiny_random_model(tmp_path_factory) -> Path:
    """A randomly initialised 1-layer Qwen2 with a character-level tokenizer and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny_random_model")
    chars = sorted(set("0123456789+-*/=()^.,:;?!$\\{}_ "
                       "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"))
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}A: {% endif %}")
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def test_cli_model_end_to_end(tiny_random_model, tmp_path):
    pytest.importorskip("rewards")
    custom = tmp_path / "custom.jsonl"
    custom.write_text(json.dumps({"question": "What is 1+1?", "answer": "2"}) + "\n"
                      + json.dumps({"question": "2*3?", "answer": "6"}))
    benchmarks = [str(custom)] + (["amc23"] if BENCH.is_dir() else [])
    out = tmp_path / "out"
    cmd = [sys.executable, "eval.py", "--model", str(tiny_random_model),
           "--benchmarks", ",".join(benchmarks),
           "--data-dir", str(BENCH), "--limit", "2", "--k", "2", "--max-new-tokens", "6",
           "--batch-size", "4",
           "--out-dir", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ("| benchmark | problems | avg@2 | pass@2 | maj@2 | tokens | trunc | entropy |"
            in proc.stdout)
    results = json.loads((out / "results.json").read_text())
    assert list(results["benchmarks"]) == ["custom"] + (["amc23"] if BENCH.is_dir() else [])
    for name, r in results["benchmarks"].items():
        assert r["n"] == 2 and len(results["problems"][name][0]["correct"]) == 2
        assert 0 < r["response_len"] <= 6 and 0 <= r["truncation_rate"] <= 1
    assert set(results["macro"]) == {*ev.METRICS, "n"}


def test_save_correct_writes_only_verified_completions(tiny_random_model, tmp_path, monkeypatch):
    """RLEP phase I: `--save-correct` keeps exactly the verified-correct samples with their token
    ids and behaviour log-probs, and writes the tokens phase I generated beside them."""
    custom = tmp_path / "custom.jsonl"
    custom.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n"
                      + json.dumps({"question": "2*3", "answer": "6"}) + "\n")
    script = {"1+1": ["\\boxed{2}", "\\boxed{3}"], "2*3": ["\\boxed{5}", "so \\boxed{6}"]}

    def fake_generate(model, tokenizer, prompts, sampling, stop, *args):
        rows, texts = [], []
        for p in prompts:
            # prompts carry the chat template
            for t in next(v for q, v in script.items() if q in tokenizer.decode(p)):
                ids = tokenizer(t, add_special_tokens=False)["input_ids"]
                rows.append(Row(ids=p + ids, prompt_len=len(p), logp=[-0.5] * len(ids),
                                truncated=False,
                                entropy=1.0))
                texts.append(t)
        n = len(rows)
        return pack(rows, tokenizer.pad_token_id, torch.zeros(n, dtype=torch.long),
                    torch.zeros(n, dtype=torch.long), 0), texts

    monkeypatch.setattr(rollout, "generate", fake_generate)  # what eval.py's HFSampler samples with
    saved = tmp_path / "phase1" / "phase1.jsonl"  # a folder that does not exist yet is created
    ev.main(["--model", str(tiny_random_model), "--benchmarks", str(custom), "--k", "2",
             "--template", "{problem}",
             # the default 1024 leaves no room in this model's 1024 positions
             "--max-new-tokens", "64",
             "--out-dir", str(tmp_path / "out"), "--save-correct", str(saved)])
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tiny_random_model)
    assert [(r["problem"], r["completion"]) for r in rows] == [("1+1", "\\boxed{2}"),
                                                              ("2*3", "so \\boxed{6}")]
    for r in rows:
        assert r["completion_ids"] == tok(r["completion"], add_special_tokens=False)["input_ids"]
        assert r["behav_logp"] == [-0.5] * len(r["completion_ids"])
    meta = json.loads(saved.with_name("phase1.jsonl.meta.json").read_text())
    assert meta["generated_tokens"] == sum(len(tok(t, add_special_tokens=False)["input_ids"])
                                           for v in script.values() for t in v)
    assert "completions" not in json.loads(
        (tmp_path / "out" / "results.json").read_text())["problems"]["custom"][0]
