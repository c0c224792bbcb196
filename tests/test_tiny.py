"""The embedded default: the procedural task and the committed tiny model, loaded the way a real
model is."""

import json
import subprocess
import sys
from fractions import Fraction

import pytest

from data.loaders import load_problems
from data.tiny_task import make_split
from rewards import verify

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = REPO / "data" / "tiny_model"


def test_task_is_seeded_and_held_out_is_fixed_and_disjoint():
    assert make_split("train", 50, seed=3) == make_split("train", 50, seed=3)
    assert make_split("train", 50, seed=3) != make_split("train", 50, seed=4)
    test = {p["problem"] for p in make_split("test", 500)}
    # independent of any training seed
    assert test == {p["problem"] for p in make_split("test", 500)}
    assert not test & {p["problem"] for p in make_split("train", 2000, seed=0)}


def test_answers_need_real_verification():
    rows = make_split("train", 400, seed=0)
    kinds = {r["kind"] for r in rows}
    assert kinds == {"add", "mul", "frac", "lin"}
    for r in rows:
        assert r["solution"].endswith("\\boxed{" + r["answer"] + "}")
        assert verify(r["solution"], r["answer"])
        value = Fraction(r["answer"])
        if r["kind"] == "frac" and value.denominator > 1:  # an unreduced fraction is right too
            assert verify(f"\\boxed{{{value.numerator * 2}/{value.denominator * 2}}}", r["answer"])
        if r["kind"] == "lin":  # the answer solves the equation
            lhs, rhs = r["problem"].split("=")
            a = lhs.split("x")[0]
            a = {"": 1, "-": -1}.get(a, None) or int(a)
            b = int(lhs.split("x")[1] or 0)
            assert a * value + b == int(rhs)
        assert not verify(f"\\boxed{{{value + 1}}}", r["answer"])
    assert any(r["answer"].startswith("-") for r in rows) and any("/" in r["answer"] for r in rows)


def test_export_jsonl_reads_back_through_the_benchmark_loader(tmp_path):
    out = tmp_path / "tiny.jsonl"
    subprocess.run([sys.executable, "-m", "data.tiny_task", "--split", "test", "--n", "20",
                    "--out", str(out)],
                   cwd=REPO, check=True)
    problems = load_problems(str(out))
    assert len(problems) == 20
    assert [p.answer for p in problems] == [p["answer"] for p in make_split("test", 20)]
    assert json.loads(out.read_text().splitlines()[0])["solution"].endswith("}")


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="data/tiny_model not built")
def test_committed_model_loads_like_a_real_one():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.build_tiny_model import build_tokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    assert model.config.model_type in ("qwen2", "qwen3")
    assert 0.8e6 <= sum(p.numel() for p in model.parameters()) <= 5e6  # "about 1–5 M parameters"
    text = tok.apply_chat_template([{"role": "user", "content": "3/4+-5/6"}], tokenize=False,
                                   add_generation_prompt=True)
    text += "9/12-10/12=-1/12 \\boxed{-1/12}\n  x"
    # what it was trained with
    assert tok(text)["input_ids"] == build_tokenizer()(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text
    info = json.loads((MODEL / "build_info.json").read_text())
    assert 0.05 <= info["heldout_sampled_accuracy_t1"] <= 0.5
