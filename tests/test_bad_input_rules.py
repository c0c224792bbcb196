"""Bad input by rule (#43), each rule with a member or two (the reviewer holds more): a checkpoint
or a model folder is whole or refused; one run per folder; nothing is written before it can
succeed; comparisons compare like with like; work is bounded before it starts; numbers and text
have domains; stderr holds one line. Each member: exit 2, one line on stderr, and (where a folder
exists) every file byte-identical afterwards.

  pytest -q -x tests/test_bad_input_rules.py        # ~4 min on 2 busy cores
"""

import errno
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from fixtures import previous_run, snapshot, train_here
from safetensors.torch import load_file, save_file

import config
import eval as ev
import train
from analysis import compare
from support import integrity

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = REPO / "data" / "tiny_model"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
       "TOKENIZERS_PARALLELISM": "false"}
TINY = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={MODEL}",
        "--rollout.batch_size=16", "--rollout.group_size=4", "--rollout.max_new_tokens=24",
        "--eval.n=8", "--eval.k=1", "--eval.every=0", "--checkpoint.every=2",
        "--checkpoint.keep_last=3", "--reward.no_answer=-1", "--replay.strategy=uniform",
        "--replay.ratio=0.25", "--threads=1", "--wandb.mode=disabled"]
EVAL = ["--model", str(MODEL), "--benchmarks", "tiny", "--limit", "2", "--k", "1",
        "--max-new-tokens", "4", "--template", "{problem}"]
needs_model = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="no tiny model")


def one_line(err: str, prefix: str = "error: ") -> str:
    """The single line of `err`: exactly one, starting with `prefix`, no traceback."""
    assert err.count("\n") == 1 and err.startswith(prefix), err[-3000:]
    assert "Traceback" not in err and "Warning" not in err
    return err


def train_refused(capsys, *args: str) -> str:
    """train.main in this process: exit 2, one line on stderr. Returns it."""
    assert train.main([*TINY, *args]) == 2
    return one_line(capsys.readouterr().err)


def eval_refused(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        ev.main([*EVAL, *args])
    assert e.value.code == 2
    return one_line(capsys.readouterr().err, "eval.py: error: ")


def run_script(*args: str, cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout, check=False)


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------ one run per folder

# The second run: train.main, its set-up held (in load_task, after where the lock is taken now and
# before where it was taken) until the test creates the file GO. The old code let it claim the
# folder after the first run had finished and run over it.
HELD = """
import os, sys, time
import train
real = train.load_task
def held(*a, **k):
    while not os.path.exists(os.environ["GO"]):
        time.sleep(0.05)
    return real(*a, **k)
train.load_task = held
sys.exit(train.main(sys.argv[1:]))
"""


@needs_model
def test_two_runs_started_together_on_one_folder_one_runs(tmp_path):
    out, go = tmp_path / "run", tmp_path / "go"
    args = [*TINY, f"--out_dir={out}", "--max_steps=1"]
    env = {**ENV, "GO": str(go)}
    popen = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True, "env": env,
             "cwd": REPO}
    plain = subprocess.Popen([sys.executable, "train.py", *args], **popen)
    held = subprocess.Popen([sys.executable, "-c", HELD, *args], **popen)
    plain.wait(timeout=300)
    first = snapshot(out) if plain.returncode == 0 else None
    go.touch()
    held.wait(timeout=300)
    codes = {plain.returncode: plain, held.returncode: held}
    assert sorted([plain.returncode, held.returncode]) == [0, 2]
    line = one_line(codes[2].stderr.read())
    assert f"out_dir {out} is in use by another run (pid " in line
    assert steps(out) == [1] and (out / "summary.json").is_file()
    if first is not None:  # the first finished before the second went on: nothing of it touched
        assert snapshot(out) == first


# ------------------------------------------------------------------- checkpoints: whole or refused


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 (each with its manifest)."""
    if not (MODEL / "config.json").is_file():
        pytest.skip("no tiny model")
    out = tmp_path_factory.mktemp("trained") / "run"
    r = train_here(*TINY, f"--out_dir={out}", "--max_steps=4")  # (train.py's main, in here)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def copy_run(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def resumed(capsys, out: Path, *args: str) -> str:
    """--resume on `out`: refused in one line, every file as it was. Returns the line."""
    before = snapshot(out)
    line = train_refused(capsys, f"--out_dir={out}", "--max_steps=6", "--resume", *args)
    assert snapshot(out) == before
    return line


def grow(f: Path) -> None:
    f.write_bytes(f.read_bytes() + b"\0")


DAMAGES = [  # (what is done to checkpoints/step_000004, what the line says)
    (lambda ck: (ck / "optimizer.pt").unlink(), "(optimizer.pt is missing)"),
    (lambda ck: (ck / "model.safetensors").unlink(), "(model.safetensors is missing)"),
    (lambda ck: grow(ck / "state_rank0.pt"), "bytes, its manifest.json says"),
    (lambda ck: (ck / "manifest.json").write_text("{"), "(manifest.json is damaged)"),
]


@pytest.mark.parametrize("damage, words", DAMAGES, ids=["optimizer", "weights", "size", "manifest"])
def test_resume_refuses_a_checkpoint_its_manifest_says_is_not_whole(trained, tmp_path, capsys,
                                                                   damage, words):
    out = copy_run(trained, tmp_path)
    damage(out / "checkpoints" / "step_000004")
    line = resumed(capsys, out)
    assert "checkpoint step_000004 is damaged " in line and words in line
    assert "the newest intact one is step_000002: --resume=step_000002" in line


def test_resume_of_a_checkpoint_whose_manifest_is_gone(trained, tmp_path, capsys):
    """A state of this layout (run.trained_rows and every other field) came with a manifest: without
    one the checkpoint is damaged, never resumed unchecked as older code's (#58)."""
    out = copy_run(trained, tmp_path)
    ck = out / "checkpoints" / "step_000004"
    (ck / "manifest.json").unlink()
    (ck / "optimizer.pt").unlink()
    line = resumed(capsys, out)
    assert "checkpoint step_000004 is damaged (manifest.json is missing)" in line
    assert "the newest intact one is step_000002: --resume=step_000002" in line


def set_state(ck: Path, change) -> None:
    """Change the trainer state of `ck` and rewrite its manifest: the fields alone are wrong."""
    state = torch.load(ck / "state_rank0.pt", weights_only=True)
    change(state)
    torch.save(state, ck / "state_rank0.pt")
    integrity.write_manifest(ck)


FIELDS = [  # (change, what the line says)
    (lambda s: s["run"].update(step=-1), "run.step must be an integer ≥ 0, got -1"),
    (lambda s: s["run"].update(data_pos="8"), "run.data_pos must be an integer ≥ 0, got '8'"),
    (lambda s: s.update(world=0), "world must be an integer ≥ 1, got 0"),
    (lambda s: s.update(world=True), "world must be an integer ≥ 1, got True"),
    (lambda s: s["run"].update(wall=math.nan), "run.wall must be a finite number ≥ 0, got nan"),
    (lambda s: s["run"].update(trained_tokens=-5), "run.trained_tokens must be an integer ≥ 0"),
    (lambda s: s["run"].update(config=[1]), "run.config must be a mapping, got [1]"),
    (lambda s: s.pop("rng"), "rng must be a mapping, got None"),
    (lambda s: s.update(replay=None), "replay must be a mapping, got None"),
    (lambda s: s["run"]["skipped"].update(gated=-1), "run.skipped must be a mapping of integers"),
    (lambda s: s.update(run=5), "trainer state without its run progress"),
    (lambda s: s["run"].update(step=7), "its trainer state is of step 7"),
]


@needs_model
@pytest.mark.parametrize("change, words", FIELDS, ids=[f[1][:24] for f in FIELDS])
def test_resume_refuses_damaged_trainer_state_fields(trained, tmp_path, capsys, change, words):
    out = copy_run(trained, tmp_path)
    set_state(out / "checkpoints" / "step_000004", change)
    line = resumed(capsys, out)
    assert "checkpoint step_000004 is damaged (" in line and words in line


def changed_state(ck: Path, change, manifest: bool) -> None:
    """The trainer state of `ck` changed by `change`; its manifest rewritten to match (`manifest`),
    or gone, as older code left it."""
    (ck / "manifest.json").unlink()
    state = torch.load(ck / "state_rank0.pt", weights_only=True)
    change(state, ck)
    if (ck / "state_rank0.pt").exists():  # (not renamed to the oldest layout's name)
        torch.save(state, ck / "state_rank0.pt")
    if manifest:
        integrity.write_manifest(ck)


def other_shape(state, ck: Path) -> None:
    opt = torch.load(ck / "optimizer.pt", weights_only=True)
    first = opt["state"][next(iter(opt["state"]))]
    first["exp_avg"] = torch.zeros(3, 5)
    torch.save(opt, ck / "optimizer.pt")


def optimizer_inside(state, ck: Path) -> None:
    state["optimizer"] = torch.load(ck / "optimizer.pt", weights_only=True)
    (ck / "optimizer.pt").unlink()


BEYOND = [  # (change, what the line says): one line each, never a traceback
    (lambda s, ck: s["run"].update(data_pos=10**30), "run.data_pos is 1000000000000000000000"),
    (lambda s, ck: s.update(world=2), "state_rank1.pt is missing, and its state says 2 processes"),
    (lambda s, ck: s.update(world=10**30), "world is 1000000000000000000000"),
    (other_shape, "optimizer.pt's exp_avg is of shape (3, 5)"),
]


@needs_model
@pytest.mark.parametrize("change, words", BEYOND, ids=[w[:24] for _, w in BEYOND])
def test_resume_of_a_state_beyond_any_run_is_one_line(trained, tmp_path, capsys, change, words):
    """A state out of any run's range, a rank's file missing, an optimizer state of another shape
    (its manifest rewritten to match) are one line naming the checkpoint."""
    out = copy_run(trained, tmp_path)
    changed_state(out / "checkpoints" / "step_000004", change, manifest=True)
    line = resumed(capsys, out)
    assert "checkpoint step_000004" in line and words in line


OLDER = [  # (change, what the line says)
    (optimizer_inside, "is of an older layout (the optimizer state inside state_rank0.pt"),
    (lambda s, ck: s["run"].pop("trained_rows"), "older layout (its trainer state has no run.tr"),
    (lambda s, ck: (ck / "state_rank0.pt").rename(ck / "trainer_state.pt"),
     "older layout (trainer_state.pt, no state_rank0.pt)"),
]


@needs_model
@pytest.mark.parametrize("change, words", OLDER, ids=[w[:24] for _, w in OLDER])
def test_resume_of_an_older_layout_is_one_line(trained, tmp_path, capsys, change, words):
    """Checkpoints of older code (no manifest, a state of their layout) are called that, with what
    to do, not damaged, and no older checkpoint is offered."""
    out = copy_run(trained, tmp_path)
    changed_state(out / "checkpoints" / "step_000004", change, manifest=False)
    line = resumed(capsys, out)
    assert "checkpoint step_000004" in line and words in line
    assert "damaged" not in line and "--model.path=" in line and "--resume=" not in line


@needs_model
def test_resume_refuses_damaged_rng_streams(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    set_state(out / "checkpoints" / "step_000004", lambda s: s["rng"].update(python="x"))
    assert "checkpoint step_000004 does not fit this run" in resumed(capsys, out)


# ------------------------------------------------------------ nothing written before it can succeed


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@needs_model
def test_failing_resume_on_a_full_disk_leaves_every_file_as_it_was(trained, tmp_path, capsys,
                                                                    monkeypatch):
    """The resumed run gets to its first checkpoint (step 6) and finds the disk full: config.yaml
    and metrics.jsonl (cut back and appended to, aside) are as they were, .lock's text too."""
    out = copy_run(trained, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:  # a line a kill cut: a resume drops it
        f.write('{"step": 5, "reward_me')
    before = snapshot(out)
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if ".tmp_step_" in str(f):
            enospc()
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    assert train.main([*TINY, f"--out_dir={out}", "--max_steps=6", "--resume"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and err.endswith(lines[0] + "\n") and "Traceback" not in err
    assert "step_000006 could not be written (OSError" in lines[0]
    assert "step_000004 is intact: free space, then --resume" in lines[0]
    assert snapshot(out) == before


@needs_model
def test_full_disk_as_a_resume_writes_its_files_aside_is_one_line(trained, tmp_path, capsys,
                                                                  monkeypatch):
    out = copy_run(trained, tmp_path)
    monkeypatch.setattr("support.rundir.Path.write_text", enospc)
    line = resumed(capsys, out)
    assert "No space left on device" in line and "step_000004" in line


# ------------------------------------------------------------------------- one model folder whole


def model_without(tmp_path: Path, what: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(MODEL, folder)
    if what == "tokenizer":
        (folder / "tokenizer.json").unlink()
        return folder
    weights = load_file(folder / "model.safetensors")
    weights.pop("model.layers.1.self_attn.q_proj.weight")
    weights["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@needs_model
@pytest.mark.parametrize("script", ["train.py", "eval.py"])
@pytest.mark.parametrize("what, words", [
    ("tensor", ["1 missing (model.layers.1.self_attn.q_proj.weight)",
                "1 unexpected (model.layers.9.mlp.up_proj.weight)"]),
    ("tokenizer", ["its tokenizer encodes a probe text to no tokens", "no tokenizer.json"])])
def test_a_model_folder_not_whole_is_one_line(tmp_path, script, what, words):
    folder = model_without(tmp_path, what)
    out = tmp_path / "out"
    if script == "train.py":
        r = run_script(script, *TINY, f"--model.path={folder}", f"--out_dir={out}")
    else:
        r = run_script(script, *EVAL, "--model", str(folder), "--out-dir", str(out))
    assert r.returncode == 2, r.stderr[-3000:]
    line = one_line(r.stderr, "eval.py: error: " if script == "eval.py" else "error: ")
    assert str(folder) in line and all(w in line for w in words), line
    assert not out.exists()


# ------------------------------------------------------------------- comparisons: like with like


def compared_run(root: Path, name: str, seed: int, config: dict | None = None,
                 rows: list[dict] | None = None, summary: dict | None = None) -> Path:
    d = root / name
    d.mkdir()
    base = {"seed": seed, "out_dir": str(d), "threads": 1, "wandb": {"name": name},
            "replay": {"strategy": "none"}, "optim": {"lr": 1e-3}, "eval": {"n": 200, "k": 4}}
    (d / "config.yaml").write_text(yaml.safe_dump(base | (config or {})))
    rows = rows or [{"step": s, "generated_tokens": 100 * s, "eval/accuracy": 0.2 + 0.1 * s}
                    for s in range(1, 4)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = {"strategy": "none", "seed": seed, "eval_accuracy_initial": 0.2,
            "tokens_generated_total": 300, "eval_response_len_final": 12.0,
            "eval_entropy_final": 0.3} | (summary or {})
    (d / "summary.json").write_text(json.dumps(text, indent=2) + "\n")
    return d


def compare_refused(capsys, tmp_path: Path, *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        compare.main([*map(str, args), "--out-dir", str(tmp_path / "cmp")])
    assert e.value.code == 2
    assert not (tmp_path / "cmp").exists()
    return one_line(capsys.readouterr().err, "compare.py: error: ")


def test_comparison_refuses_an_arm_of_different_configs(tmp_path, capsys):
    a = compared_run(tmp_path, "none-s0", 0)
    b = compared_run(tmp_path, "none-s1", 1, {"optim": {"lr": 1e-4}})
    line = compare_refused(capsys, tmp_path, a, b)
    assert f"arm 'none' pools runs of different configs: {a} and {b} differ in optim.lr" in line
    assert "--allow-mixed" in line
    compare.main([str(a), str(b), "--out-dir", str(tmp_path / "cmp"), "--allow-mixed"])
    assert (tmp_path / "cmp" / "compare.csv").is_file()
    shutil.rmtree(tmp_path / "cmp")
    c = compared_run(tmp_path, "none-s2", 2, {"eval": {"n": 200, "k": 8}})  # eval settings count
    assert "differ in eval.k" in compare_refused(capsys, tmp_path, a, c)


def test_comparison_pools_runs_that_differ_in_seed_and_folder_only(tmp_path, capsys):
    runs = [compared_run(tmp_path, f"none-s{i}", i, {"checkpoint": {"every": i}}) for i in (0, 1)]
    compare.main([*map(str, runs), "--out-dir", str(tmp_path / "cmp")])
    assert "| none | 2 |" in capsys.readouterr().out


BAD_VALUES = [  # (metrics row or summary fields, where, what the line says)
    ({"step": 2, "generated_tokens": 200, "eval/accuracy": math.nan}, "metrics.jsonl:2",
     "eval/accuracy must be in [0, 1], got NaN"),
    ({"step": 2, "generated_tokens": math.inf}, "metrics.jsonl:2",
     "generated_tokens must be finite and ≥ 0, got Infinity"),
    ({"step": 2, "generated_tokens": -200}, "metrics.jsonl:2",
     "generated_tokens must be finite and ≥ 0, got -200"),
    ({"step": 2, "generated_tokens": 200, "eval/accuracy": 1.5}, "metrics.jsonl:2",
     "eval/accuracy must be in [0, 1], got 1.5"),
    ({"step": -2, "generated_tokens": 200}, "metrics.jsonl:2", "step must be finite and ≥ 0"),
    ({"eval_accuracy_initial": math.nan}, "summary.json:4",
     "eval_accuracy_initial must be in [0, 1], got NaN"),
    ({"tokens_generated_total": -1}, "summary.json:5",
     "tokens_generated_total must be finite and ≥ 0, got -1"),
]


@pytest.mark.parametrize("values, where, words", BAD_VALUES, ids=[b[2][:30] for b in BAD_VALUES])
def test_comparison_refuses_values_outside_their_domain(tmp_path, capsys, values, where, words):
    if where.startswith("metrics"):
        rows = [{"step": 1, "generated_tokens": 100, "eval/accuracy": 0.3}, values]
        run = compared_run(tmp_path, "none-s0", 0, rows=rows)
    else:
        run = compared_run(tmp_path, "none-s0", 0, summary=values)
    line = compare_refused(capsys, tmp_path, run)
    assert f"{run / where}: {words}" in line


@pytest.mark.parametrize("args, words", [
    (["--target", "nan"], "--target must be an accuracy in [0, 1], got nan"),
    (["--target", "1.5"], "--target must be an accuracy in [0, 1], got 1.5"),
    (["--budget", "inf"], "--budget must be finite and > 0, got inf"),
    (["--target", "x"], "argument --target: invalid float value: 'x'")])
def test_comparison_refuses_numbers_outside_their_domain(tmp_path, capsys, args, words):
    run = compared_run(tmp_path, "none-s0", 0)
    assert words in compare_refused(capsys, tmp_path, run, *args)
    r = run_script("eval.py", "--compare", str(run), *args, "--out-dir", str(tmp_path / "cmp"))
    assert r.returncode == 2 and words in one_line(r.stderr, "eval.py: error: ")


# --------------------------------------------------------------- work bounded before it starts


@needs_model
def test_a_huge_template_is_refused_in_seconds(tmp_path, capsys):
    template = "Solve it. " * 10_000 + "{problem}"  # 100 KB
    out = tmp_path / "run"
    t0 = time.perf_counter()
    line = train_refused(capsys, f"--data.template={template}", f"--out_dir={out}")
    assert time.perf_counter() - t0 < 20
    assert "data.template (with data.system_prompt and the chat template) is 100,009 char" in line
    assert not out.exists()
    t0 = time.perf_counter()
    line = eval_refused(capsys, "--template", template, "--out-dir", str(out))
    assert time.perf_counter() - t0 < 20 and "--template (with --system-prompt" in line


@needs_model
def test_eval_refuses_problems_over_the_context(tmp_path, capsys):
    f = tmp_path / "huge.jsonl"
    f.write_text(json.dumps({"problem": "1+" * 1_000_000 + "1", "answer": "1000001"}) + "\n")
    t0 = time.perf_counter()
    line = eval_refused(capsys, "--benchmarks", str(f), "--out-dir", str(tmp_path / "out"))
    assert "every problem of huge is over 508 tokens" in line and time.perf_counter() - t0 < 20
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ numbers and text have domains


@needs_model
@pytest.mark.parametrize("args, words", [
    (["--rollout.temperature=1e-300"], ("rollout.temperature must be > 0: at least 0.001 and "
                                        "below 1e6, got 1e-300")),
    (["--eval.temperature=1e-300"], "eval.temperature must be 0 (greedy) or in [0.001, 1e6)"),
    (["--out_dir=" + "x" * 300], ("out_dir must be a folder name, not empty, that the file "
                                  "system can hold (it has a component of 300 bytes")),
    (["--out_dir=" + "/x" * 2100], "bytes long, over 4,000"),
    (["--data.system_prompt=\ud800"], "config key data.system_prompt: its text holds a lone"),
])
def test_values_outside_their_domain_are_one_line(tmp_path, capsys, args, words):
    out = tmp_path / "run"
    before = previous_run(out)
    assert words in train_refused(capsys, f"--out_dir={out}", "--overwrite", *args)
    assert snapshot(out) == before


def test_an_out_dir_holding_a_nul_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = train_refused(capsys, "--out_dir=runs/a\0b")
    assert "that the file system can hold (it holds a NUL byte)" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, words", [
    ("optim:\n  1: 3\n", "keys must be names, got 1 (int) in optim."),
    ("seed: 1\n~: 2\n", "keys must be names, got None (NoneType) in the top level"),
    ("rollout:\n  yes: 2\n", "keys must be names, got True (bool) in rollout."),
])
def test_config_keys_that_are_not_names_are_one_line(tmp_path, capsys, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    line = train_refused(capsys, "--config", str(f), f"--out_dir={tmp_path / 'run'}")
    assert f"config file {f}: {words}" in line and not (tmp_path / "run").exists()


@needs_model
def test_a_lone_surrogate_in_a_problem_is_one_line(tmp_path, capsys):
    f = tmp_path / "train.jsonl"
    good = json.dumps({"problem": "1+1", "answer": "2"})
    f.write_text(good + '\n{"problem": "1+\\ud800", "answer": "2"}\n')
    out = tmp_path / "run"
    before = previous_run(out)
    line = train_refused(capsys, f"--data.train={f}", f"--out_dir={out}", "--overwrite")
    assert f"error: data: {f}:2: a lone UTF-16 surrogate" in line
    assert snapshot(out) == before
    line = eval_refused(capsys, "--benchmarks", str(f), "--out-dir", str(out / "eval"))
    assert f"{f}:2: a lone UTF-16 surrogate" in line and not (out / "eval").exists()


@pytest.mark.parametrize("args, words", [
    (["--temperature", "1e-300"], "--temperature must be 0 (greedy) or in [0.001, 1e6)"),
    (["--out-dir", "x" * 300], "--out-dir 'xxxx"),
    (["--save-correct", "a\0b.jsonl"], "--save-correct 'a\\x00b.jsonl' holds a NUL byte"),
    (["--save-correct", "y" * 250 + ".jsonl"], "has a component of 266 bytes"),
    (["--k", "abc"], "argument --k: invalid int value: 'abc'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_eval_values_outside_their_domain_are_one_line(tmp_path, capsys, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    assert words in eval_refused(capsys, *args)
    assert list(tmp_path.iterdir()) == []


def test_eval_without_arguments_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        ev.main([])
    assert e.value.code == 2
    line = one_line(capsys.readouterr().err, "eval.py: error: ")
    assert "the following arguments are required: --model" in line


# ------------------------------------------------------------------ one line when the disk fills


class FullFile:
    """A file on a full disk: it opens, and its first write fails."""

    def __init__(self, path, mode="r", *a, **k):
        self.f = open(path, mode, *a, **k)

    def write(self, text):
        enospc()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@needs_model
@pytest.mark.parametrize("where", ["completions", "meta"])
def test_a_full_disk_under_save_correct_is_one_line_and_leaves_no_file(tmp_path, capsys,
                                                                       monkeypatch, where):
    if where == "completions":
        monkeypatch.setattr(ev, "open", FullFile, raising=False)
    else:
        monkeypatch.setattr(ev, "write_file", enospc)
    saved = tmp_path / "phase1.jsonl"
    args = ["--limit", "8", "--k", "4", "--max-new-tokens", "24", "--temperature", "1.0"]
    with pytest.raises(SystemExit) as e:
        ev.main([*EVAL, *args, "--save-correct", str(saved), "--out-dir", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    bars = ("it/s]", "s/it]")  # the eval's progress bar: besides it, the error alone
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.endswith(bars)]
    assert lines == [f"eval.py: error: cannot write {saved}: No space left on device"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------------------------- domains still open (#49): config rules

HUGE = str(10**30)
NEW = ["--rollout.max_new_tokens=24"]
SKIP = ["--skip.enabled=true"]
DOMAINS = [  # (overrides, what the line says): every rule names its key and what it must be
    ([*NEW, "--reward.overlong_buffer=30"],
     "reward.overlong_buffer must be ≤ rollout.max_new_tokens (24)"),
    ([*NEW, "--reward.overlong_buffer=25"], "a longer buffer punishes every completion, got 25"),
    ([*SKIP, "--skip.easy=1.5"], "skip.easy must be ≤ 1, the most a completion's reward can be"),
    ([*SKIP, "--reward.correct=0.5"], "skip.easy must be ≤ 0.5, the most"),
    ([*SKIP, "--skip.hard=-0.5"], "skip.hard must be ≥ 0, the least a completion's reward can be"),
    ([*SKIP, "--reward.no_answer=-1", "--skip.hard=-1.5"], "skip.hard must be ≥ -1, the least"),
    ([*SKIP, *NEW, "--reward.overlong_buffer=4", "--skip.hard=-1.5"], "skip.hard must be ≥ -1,"),
    ([f"--optim.micro_batch_size={HUGE}"], "optim.micro_batch_size must be > 0 and ≤ 10^9, got 1"),
    ([f"--optim.logprob_batch_size={HUGE}"], "optim.logprob_batch_size must be > 0 and ≤ 10^9"),
    ([f"--optim.micro_batch_tokens={HUGE}"], "micro_batch_tokens must be ≥ 0 (0 = off) and ≤ 10^9"),
    ([f"--rollout.gen_batch_size={HUGE}"], "rollout.gen_batch_size must be > 0 and ≤ 10^9"),
    (["--replay.module=.x"], "replay.module must be a module name on sys.path"),
    (["--replay.module=..x.y"], "replay.module must be a module name on sys.path"),
]
VALID = [  # the edges of the same rules: accepted
    [*NEW, "--reward.overlong_buffer=24"],  # the penalty falls from length 0 (test_rollout's)
    [*SKIP, "--skip.easy=1.0", "--skip.hard=0"],
    [*SKIP, "--reward.format_bonus=0.5", "--skip.easy=1.5"],  # a boxed right answer gets 1.5
    [*SKIP, *NEW, "--reward.overlong_buffer=4", "--skip.hard=-1"],  # the penalty reaches −1
    ["--reward.correct=0.5"],  # skipping off: its thresholds are never read
    ["--optim.micro_batch_size=1000000000", "--optim.micro_batch_tokens=0"],
]


@pytest.mark.parametrize("overrides, words", DOMAINS, ids=[d[1][:30] for d in DOMAINS])
def test_config_domains_still_open_are_refused(overrides, words):
    """reward.overlong_buffer below rollout.max_new_tokens; skip.easy and skip.hard within the
    rewards a completion can get (RewardConfig.bounds) when skipping is on; the batch knobs
    bounded (10^30 overflowed in torch); replay.module an absolute name (.x: a traceback)."""
    with pytest.raises(config.ConfigError) as e:
        config.validate(config.load_config(None, overrides))
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides", VALID)
def test_config_domains_edges_are_accepted(overrides):
    config.validate(config.load_config(None, overrides))


@needs_model
@pytest.mark.parametrize("args, words", [
    ([f"--optim.micro_batch_size={HUGE}"], "optim.micro_batch_size must be > 0 and ≤ 10^9"),
    (["--replay.module=.x"], "replay.module must be a module name on sys.path"),
    (["--reward.overlong_buffer=25"], "reward.overlong_buffer must be ≤ rollout.max_new_tokens"),
    (["--skip.enabled=true", "--skip.easy=2"], "skip.easy must be ≤ 1, the most")])
def test_train_refuses_domains_still_open_in_one_line(tmp_path, args, words):
    out = tmp_path / "run"
    r = run_script("train.py", *TINY, f"--out_dir={out}", *args)
    assert r.returncode == 2 and words in one_line(r.stderr), r.stderr[-3000:]
    assert not out.exists()


@needs_model
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_eval_refuses_a_model_with_weights_not_finite(tmp_path, value):
    """NaN (or inf) weights: one line naming the folder and the weight, before anything is
    generated or written (it was FloatingPointError's traceback from the sampler)."""
    folder = tmp_path / "model"
    shutil.copytree(MODEL, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] = value
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    r = run_script("eval.py", *EVAL, "--model", str(folder), "--out-dir", str(out))
    assert r.returncode == 2, r.stderr[-3000:]
    line = one_line(r.stderr, "eval.py: error: ")
    assert f"model {folder}: weight model.layers.1.mlp.up_proj.weight is not finite" in line
    assert not out.exists()
