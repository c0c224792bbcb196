"""The bench/ scripts are user tools and keep train.py's rules (#58), enforced in bench/cli.py:
bad input (a zero, a negative, not a number, an unknown arm, a device or a dependency that is not
there, a vocabulary below the tokenizer's, an output folder that is missing or an output file that
exists) is one line on stderr and exit 2, with no traceback and nothing written; a kept run is
never replaced without --overwrite.

Each case runs the script's real `__main__` (runpy, in this process: seconds, not a new interpreter
each); CASES_BY_PROCESS run as the user runs them, one per rule, in a subprocess.

  pytest -q tests/test_bench_cli.py
"""

import argparse
import importlib.util
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import REPO, snapshot
from test_checkpoint import needs_model, run_train

from bench import cli

KEPT = REPO / "docs" / "kept_runs" / "lookahead" / "gxpo-s0"  # a committed kept run
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def absent(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is not None,
                              reason=f"{module} is installed")


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")


def one_line(err: str, script: str) -> str:
    """The single line of `err`: exactly one, `script: error: ...`, no traceback."""
    assert err.count("\n") == 1 and err.startswith(f"{script}: error: "), err[-3000:]
    assert "Traceback" not in err
    return err


def run_main(script: str, args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """bench/SCRIPT ARGS through its `if __name__ == "__main__":` block in this process: (exit
    code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the scripts insert their folders)
    code = 0
    try:
        runpy.run_path(str(REPO / "bench" / script), run_name="__main__")
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A scratch folder as the current one, holding a file where a folder is asked for, a kept
    run, an earlier record and a run folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("a file, not a folder\n")
    shutil.copytree(KEPT, tmp_path / "kept" / "gxpo-s0")
    (tmp_path / "record.json").write_text('{"earlier": true}\n')
    return tmp_path


# (script, arguments, what the line says): each script's bad input, one rule or two a script
CASES = [
    ("generation.py", ["--rows", "0"], "argument --rows: must be ≥ 1, got 0"),
    ("generation.py", ["--repeats", "two"], "argument --repeats: must be a whole number"),
    ("generation.py", ["--arms", "default,fast"], "argument --arms: unknown 'fast'; choose"),
    ("generation.py", ["--tokens", "16,16"], "argument --tokens: must be T1,T2 with T1 < T2"),
    ("generation.py", ["--device", "tpu"], "argument --device: must be cpu or cuda[:N]"),
    ("generation.py", ["--vocab", "100"], "--vocab 100 is below the tokenizer's 274 tokens"),
    ("generation.py", ["--mean-len", "-1"], "argument --mean-len: must be ≥ 1, got -1"),
    ("generation.py", ["--rows", "10", "--group", "3"], "not a multiple of --group 3"),
    ("generation.py", ["--measure", "decode"], "argument --measure: invalid choice"),
    ("generation.py", ["--json", "missing/out.json"], "is in a folder that does not exist"),
    ("generation.py", ["--json", "record.json"], "exists; pass --overwrite to replace it"),
    ("generation.py", ["--json", "FILE/out.json"], "which is a file, not a folder"),
    ("generation.py", ["--json", ""], "--json '' is empty"),
    ("budget.py", ["--root", "nowhere"], "--root nowhere: not a folder"),
    ("fingerprint.py", ["none", "fast"], "unknown case fast (--list names them)"),
    ("gpu_check.py", ["--prompts", "0"], "argument --prompts: must be ≥ 1, got 0"),
    ("gpu_check.py", ["--shape", "Qwen/Qwen9"], "--shape 'Qwen/Qwen9': not a shape of"),
    ("gpu_check.py", ["--json", "record.json"], "exists; pass --overwrite"),
    ("memory_plan.py", ["--measure"], "unrecognized arguments: --measure"),
    ("plot.py", ["only_one.json"], "the following arguments are required: out_png"),
    ("reproduce_tiny.py", ["--names", "none", "fast"], "<name>.yaml for ['fast']"),
    ("reproduce_tiny.py", ["--jobs", "0"], "argument --jobs: must be ≥ 1, got 0"),
    ("reproduce_tiny.py", ["--seeds", "0", "0"], "--seeds names a seed twice"),
    ("reproduce_tiny.py", ["--names", "none", "aper", "--baseline", "none,none_lr2x"],
     "the comparison needs its baseline: include none_lr2x"),
    ("reproduce_tiny.py", ["--names", "aper"], "the comparison needs its baseline: include none"),
    ("reproduce_tiny.py", ["--configs", "configs/fair", "--continue-to", "150"],
     "--continue-to 150: not past none's 150 steps"),
    ("reproduce_tiny.py", ["--continue-to", "0"], "argument --continue-to: must be ≥ 1, got 0"),
    ("trace_step.py", ["--max", "x"], "argument --max: must be a whole number"),
    ("trace_step.py", ["--", "--replay.strategy=lifo"], "replay.strategy must be one of"),
    ("keep_runs.py", ["kept/gxpo-s0"], "the following arguments are required: --out"),
]
NEEDS = [  # (script, arguments, the missing module, what the line says)
    ("plot.py", ["cmp.json", "cmp.png", "--cost"], "matplotlib", "needs matplotlib, not installed"),
]


@pytest.mark.parametrize("script, args, words", CASES,
                         ids=[f"{c[0]}:{' '.join(c[1])[:30]}" for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(work, monkeypatch, capsys, script, args,
                                                         words):
    before = snapshot(work)
    code, out, err = run_main(script, args, monkeypatch, capsys)
    assert code == 2, (out + err)[-3000:]
    assert words in one_line(err, script) and out == ""
    assert snapshot(work) == before


def test_reproduce_tiny_continues_only_arms_of_one_length_and_eval_grid(tmp_path, monkeypatch,
                                                                        capsys):
    """--continue-to on arms of other eval intervals is one line, exit 2, before anything is
    written (the rule's crossings would be taken on other evals than the comparison's)."""
    configs = tmp_path / "configs"
    configs.mkdir()
    base = {"base": str(REPO / "configs" / "tiny.yaml")}
    (configs / "none.yaml").write_text(json.dumps(base))
    (configs / "sparse.yaml").write_text(json.dumps(base | {"eval": {"every": 30}}))
    out = tmp_path / "runs"

    def no_run(*args, **kwargs):  # (a run started is the rule broken)
        raise AssertionError(f"ran {args}")

    monkeypatch.setattr(subprocess, "run", no_run)
    args = ["--configs", str(configs), "--out", str(out), "--continue-to", "300"]
    code, printed, err = run_main("reproduce_tiny.py", args, monkeypatch, capsys)
    assert code == 2 and printed == "", err
    assert "the arms must share max_steps and eval.every (none: 60 steps, an eval every 10; " \
        "sparse: 60 steps, an eval every 30)" in one_line(err, "reproduce_tiny.py")
    assert not out.exists()
    code, printed, err = run_main("reproduce_tiny.py", args[:4] + ["--names", "none", "--seeds",
                                  "0", "--continue-to", "50"], monkeypatch, capsys)
    assert "not past none's 60 steps" in err  # (one grid: the other checks still run)


@pytest.mark.parametrize("script, args, module, words", NEEDS, ids=[n[0] for n in NEEDS])
def test_a_missing_dependency_is_found_before_any_work(work, monkeypatch, capsys, script, args,
                                                       module, words):
    """A script once ran for 46 s before a dependency's import failed: now the first thing (the
    module hidden where it is installed: CI installs matplotlib, to test the plots)."""
    find_spec = importlib.util.find_spec

    def hidden(name, *args):  # `module` looks not installed; every other one as it is
        if name == module:
            return None
        return find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    before = snapshot(work)
    code, out, err = run_main(script, args, monkeypatch, capsys)
    assert code == 2 and words in one_line(err, script) and out == ""
    assert snapshot(work) == before


@no_gpu
@pytest.mark.parametrize("script", ["generation.py"])
def test_cuda_without_a_gpu_is_refused_before_the_model_is_built(work, monkeypatch, capsys,
                                                                   script):
    code, _, err = run_main(script, ["--device", "cuda"], monkeypatch, capsys)
    assert code == 2 and "argument --device: cuda: no GPU is visible" in one_line(err, script)


CASES_BY_PROCESS = [  # one per rule, as the user runs it: (script, arguments, what the line says)
    ("generation.py", ["--layers", "-1"], "argument --layers: must be ≥ 0, got -1"),
    ("reproduce_tiny.py", ["--seeds", "-1"], "argument --seeds: must be ≥ 0, got -1"),
    ("keep_runs.py", ["kept/gxpo-s0", "--out", "kept"], "is already kept in kept"),
]


@pytest.mark.parametrize("script, args, words", CASES_BY_PROCESS,
                         ids=[c[0] for c in CASES_BY_PROCESS])
def test_bad_input_as_the_user_runs_it(work, script, args, words):
    """A new interpreter: what a first import prints (a dependency's warning) is on stderr too."""
    before = snapshot(work)
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=work, env=ENV,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert words in one_line(r.stderr, script) and r.stdout == ""
    assert snapshot(work) == before


# ------------------------------------------------------------------------------ bench/keep_runs.py


def run_named(root: Path, name: str) -> Path:
    """A finished run folder `root/name` (the committed kept run's files, one eval changed)."""
    run = root / name
    shutil.copytree(KEPT, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[1]["eval/accuracy"] = 0.123456
    for row in rows:  # a step's method state, which steps.jsonl keeps (and no other key)
        row["lookahead/active"] = float(row["step"] == 10)
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


def test_keep_runs_never_replaces_a_kept_run_without_overwrite(work, monkeypatch, capsys):
    """A run named like a committed kept run, kept into its folder: refused, every kept file as it
    was (it was silently overwritten); --overwrite replaces it, with the new run's eval."""
    run = run_named(work / "runs", "gxpo-s0")
    before = snapshot(work / "kept")
    code, out, err = run_main("keep_runs.py", [str(run), "--out", "kept"], monkeypatch, capsys)
    assert code == 2 and out == ""
    line = one_line(err, "keep_runs.py")
    assert "kept/gxpo-s0/config.yaml' exists; pass --overwrite to replace it" in line
    assert snapshot(work / "kept") == before
    code, out, _ = run_main("keep_runs.py", [str(run), "--out", "kept", "--overwrite"],
                            monkeypatch, capsys)
    assert code == 0 and "-> kept/gxpo-s0 (15 rows, 15 steps)" in out
    assert '"eval/accuracy": 0.123456' in (work / "kept" / "gxpo-s0" / "metrics.jsonl").read_text()
    steps = (work / "kept" / "gxpo-s0" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in steps][1] == {"step": 20, "lookahead/active": 0.0}



@needs_model
def test_keep_runs_restores_step_0_evals_from_the_runs_checkpoint(tmp_path, monkeypatch, capsys):
    """A finished run whose summary.json lacks step 0's pass@k, maj@k and greedy (as code before
    4f03516 wrote it) is kept with the values its newest checkpoint saved: those train.py had
    written, and the checkpoint named; a run whose summary has them is kept as it is; a damaged
    checkpoint is one line, before anything is written."""
    run = tmp_path / "runs" / "none-s0"
    assert run_train(run, "--eval.k=2", steps=2).returncode == 0
    summary = json.loads((run / "summary.json").read_text())
    lacking = ("eval_pass_at_k_initial", "eval_maj_at_k_initial", "eval_greedy_initial")
    assert all(summary[key] is not None for key in lacking)
    old = {key: value for key, value in summary.items() if key not in lacking}
    (run / "summary.json").write_text(json.dumps(old))
    code, _, err = run_main("keep_runs.py", [str(run), "--out", str(tmp_path / "kept")],
                            monkeypatch, capsys)
    assert code == 0, err
    kept = json.loads((tmp_path / "kept" / "none-s0" / "summary.json").read_text())
    assert kept == summary | {"eval_initial_from": "checkpoints/step_000002/state_rank0.pt"}
    (run / "summary.json").write_text(json.dumps(summary))
    code, _, err = run_main("keep_runs.py", [str(run), "--out", str(tmp_path / "kept2")],
                            monkeypatch, capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "kept2" / "none-s0" / "summary.json").read_text()) == summary
    # a damaged checkpoint (read_state checks it whole): one line, nothing kept
    (run / "summary.json").write_text(json.dumps(old))
    state = run / "checkpoints" / "step_000002" / "state_rank0.pt"
    state.write_bytes(state.read_bytes()[:100])
    code, _, err = run_main("keep_runs.py", [str(run), "--out", str(tmp_path / "kept3")],
                            monkeypatch, capsys)
    assert code == 2 and "checkpoint step_000002 is damaged" in one_line(err, "keep_runs.py")
    assert not (tmp_path / "kept3").exists()

def test_keep_runs_refuses_two_runs_of_one_name(work, monkeypatch, capsys):
    """Two runs named gxpo-s1 from two folders would be kept in one: the second replaced the
    first. Refused before either is written, with or without --overwrite."""
    a, b = run_named(work / "a", "gxpo-s1"), run_named(work / "b", "gxpo-s1")
    for extra in ([], ["--overwrite"]):
        code, _, err = run_main("keep_runs.py", [str(a), str(b), "--out", "new", *extra],
                                monkeypatch, capsys)
        assert code == 2
        assert f"{a} and {b} are both named gxpo-s1" in one_line(err, "keep_runs.py")
        assert not (work / "new").exists()


def test_keep_runs_reads_every_run_before_writing_any(work, monkeypatch, capsys):
    """An unfinished run after a good one: refused, and the good one is not kept either."""
    good = run_named(work / "runs", "gxpo-s2")
    unfinished = run_named(work / "runs", "gxpo-s3")
    (unfinished / "summary.json").unlink()
    code, _, err = run_main("keep_runs.py", [str(good), str(unfinished), "--out", "new"],
                            monkeypatch, capsys)
    assert code == 2 and "is not a finished run (no summary.json)" in one_line(err, "keep_runs.py")
    assert not (work / "new").exists()
    code, _, err = run_main("keep_runs.py", [str(good), "--out", ""], monkeypatch, capsys)
    assert code == 2 and "--out '' is empty" in one_line(err, "keep_runs.py")
    assert not (work / "gxpo-s2").exists()  # (not into the current folder)


# ---------------------------------------------------------------------------------- bench/cli.py


def test_number_types_refuse_zeros_negatives_and_non_numbers():
    assert cli.positive_int("3") == 3 and cli.count("0") == 0
    assert cli.positive_float("2.5") == 2.5
    for parse, text in ((cli.positive_int, "0"), (cli.positive_int, "-2"),
                        (cli.positive_int, "1.5"), (cli.count, "-1"), (cli.count, "x"),
                        (cli.positive_float, "0"), (cli.positive_float, "-1"),
                        (cli.positive_float, "inf"), (cli.positive_float, "nan"),
                        (cli.positive_float, "fast")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_names_are_known_and_each_given_once():
    arms = cli.names(("a", "b"))
    assert arms("b,a") == ["b", "a"]
    for text in ("a,c", "a,a", "", "a,"):
        with pytest.raises(argparse.ArgumentTypeError):
            arms(text)


def test_output_faults(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    assert cli.file_fault(str(tmp_path / "new.json"), overwrite=False) is None
    assert cli.file_fault(str(tmp_path / "file"), overwrite=True) is None
    assert "exists; pass --overwrite" in cli.file_fault(str(tmp_path / "file"), overwrite=False)
    assert "is a folder" in cli.file_fault(str(tmp_path / "folder"), overwrite=True)
    assert "does not exist" in cli.file_fault(str(tmp_path / "no" / "x.json"), overwrite=False)
    assert cli.file_fault(str(tmp_path / "no" / "x.json"), False, makes_folder=True) is None
    assert "a file, not a folder" in cli.file_fault(str(tmp_path / "file" / "x"), False)
    assert cli.file_fault(" ", False) == "is empty" and cli.folder_fault("") == "is empty"
    assert "NUL" in cli.folder_fault("a\0b")
    assert "is a file, not a folder" in cli.folder_fault(str(tmp_path / "file"))
    assert f"is under {tmp_path / 'file'}, a file" in cli.folder_fault(str(tmp_path / "file/a/b"))
    assert cli.folder_fault(str(tmp_path / "new" / "deeper")) is None
