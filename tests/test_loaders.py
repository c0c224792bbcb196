"""data/loaders.py: the shared benchmark files load with the right counts and self-verifying gold
answers, and the training-set schemas load from small fixture files written here."""

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from data.loaders import Problem, last_boxed, load_problems

SHARED = Path(os.environ.get("SHARED_DATA_DIR",
                             Path(__file__).resolve().parents[2] / "shared" / "data"))
BENCH = SHARED / "benchmarks"
COUNTS = {"math500": 500, "gsm8k": 1319, "aime24": 30, "aime25": 30, "amc23": 40}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def benchmarks() -> dict[str, list[Problem]]:
    if not BENCH.is_dir():
        pytest.skip(f"shared benchmark files not found at {BENCH} (set SHARED_DATA_DIR)")
    return {name: load_problems(name, data_dir=str(BENCH)) for name in COUNTS}


@pytest.mark.parametrize("name", COUNTS)
def test_benchmark_row_counts(benchmarks, name):
    problems = benchmarks[name]
    assert len(problems) == COUNTS[name]
    assert all(p.problem and p.answer for p in problems)
    assert len({p.id for p in problems}) == len(problems)  # ids are unique


def test_benchmark_gold_strings_as_published(benchmarks):
    aime24 = [p.answer for p in benchmarks["aime24"]]
    assert aime24[0] == "204" and "025" in aime24  # zero padding kept; the verifier normalises
    # JSON floats 27.0 -> "27"
    assert [p.answer for p in benchmarks["amc23"]][:3] == ["27", "36", "45"]
    assert benchmarks["aime25"][0].answer == "70"  # JSON int
    gsm = [p.answer for p in benchmarks["gsm8k"]]
    assert gsm[0] == "18" and "2,125" in gsm  # text after ####, commas kept
    assert benchmarks["math500"][0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert benchmarks["math500"][0].id == "test/precalculus/807.json"


@pytest.mark.parametrize("name", COUNTS)
def test_benchmark_gold_verifies_against_itself(benchmarks, name):
    rewards = pytest.importorskip("rewards")
    failed = [p.answer for p in benchmarks[name]
              if not rewards.verify(f"The answer is \\boxed{{{p.answer}}}.", p.answer)]
    assert failed == []


def test_limit(benchmarks):
    assert len(load_problems("gsm8k", data_dir=str(BENCH), limit=7)) == 7


def test_dapo_chat_schema_and_named_training_file(tmp_path):
    wrapped = (
        "Solve the following math problem step by step. The last line of your response should be "
        "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
        "\n\nWhat is 2+3?\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    row = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": wrapped}],
           "reward_model": {"ground_truth": "5", "style": "rule"}, "extra_info": {"index": "a1"}}
    other = [{"role": "user", "content": wrapped.replace("2+3", "2-9")}]  # (one gold a problem)
    write_jsonl(tmp_path / "dapo17k_train.jsonl",
                [row, row | {"prompt": other,
                             "reward_model": {"ground_truth": "-7", "style": "rule"}}])
    problems = load_problems("dapo17k", data_dir=str(tmp_path))
    assert problems[0] == Problem("What is 2+3?", "5", "dapo17k-0", "dapo17k")
    assert problems[1].problem == "What is 2-9?" and problems[1].answer == "-7"


def test_dapo_flat_and_math_train_and_gsm8k_train(tmp_path):
    flat = write_jsonl(tmp_path / "flat.jsonl", [{"prompt": "Compute 6*7.", "solution": "42"}])
    assert load_problems(str(flat))[0] == Problem("Compute 6*7.", "42", "flat-0", "flat")

    solution = "So $x=\\boxed{3}$ first, and finally $\\boxed{\\frac{1}{\\sqrt{2}}}$."
    math_train = write_jsonl(tmp_path / "math_train.jsonl",
                             [{"problem": "P", "solution": solution, "level": "Level 2"}])
    # last \boxed, nested braces
    assert load_problems(str(math_train))[0].answer == "\\frac{1}{\\sqrt{2}}"
    write_jsonl(math_train, [{"problem": "P", "solution": solution, "answer": "7"}])
    # explicit answer wins
    assert load_problems("math_train", data_dir=str(tmp_path))[0].answer == "7"

    gsm = write_jsonl(tmp_path / "gsm8k_train.jsonl",
                      [{"question": "Q?", "answer": "1000+234=<<1000+234=1234>>1234\n#### 1,234"}])
    assert load_problems("gsm8k_train", data_dir=str(tmp_path))[0].answer == "1,234"
    assert load_problems(str(gsm))[0].problem == "Q?"


def test_custom_field_mapping(tmp_path):
    path = write_jsonl(tmp_path / "custom.jsonl",
                       [{"q": "Q1", "meta": {"gold": 0.5}, "answer": "wrong field"}])
    p = load_problems(str(path), problem_key="q", answer_key="meta.gold")[0]
    assert (p.problem, p.answer) == ("Q1", "0.5")
    with pytest.raises(ValueError, match="no problem field"):
        load_problems(str(path))


def test_bad_inputs_give_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        load_problems(str(bad))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_problems(str(tmp_path / "empty.jsonl"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_problems(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="math500_test.jsonl"):
        load_problems("math500", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs data_dir"):
        load_problems("math500")
    with pytest.raises(ValueError, match="unknown benchmark 'math5000'"):
        load_problems("math5000", data_dir=str(tmp_path))
    no_answer = write_jsonl(tmp_path / "noans.jsonl", [{"problem": "a"}])
    with pytest.raises(ValueError, match="no answer field"):
        load_problems(str(no_answer))


def test_parquet(tmp_path):
    path = tmp_path / "dapo.parquet"
    if importlib.util.find_spec("pandas") is None:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pandas pyarrow"):
            load_problems(str(path))
        return
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame([{"prompt": [{"role": "user", "content": "Q"}],
                   "reward_model": {"ground_truth": "9", "style": "rule"}}]).to_parquet(path)
    assert load_problems(str(path))[0].answer == "9"


def test_hub_without_datasets_package():
    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed; loading from the hub would need the network")
    with pytest.raises(ImportError, match="pip install datasets"):
        load_problems("hf:openai/gsm8k:main:test")


def test_last_boxed():
    assert last_boxed("\\boxed{1} then \\boxed{\\{a, b\\}}") == "\\{a, b\\}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{unclosed") is None


def test_tiny_task_knobs_are_the_data_tiny_section():
    from config import load_config, validate
    from data.loaders import load_task

    knobs = ["--data.tiny.train_size=40", "--data.tiny.max_int=12", "--data.tiny.kinds=add:1"]
    cfg = load_config("configs/tiny.yaml", knobs)
    validate(cfg)
    train, held_out = load_task(cfg.data, 10)
    assert len(train) == 40 and len(held_out) == 10
    for p in train + held_out:  # add problems only, operands within max_int
        a, _op, b = re.fullmatch(r"(-?\d+)([+-])(-?\d+)", p.problem).groups()
        assert max(abs(int(a)), abs(int(b))) <= 12
    assert not {p.problem for p in train} & {p.problem for p in held_out}
