"""Reliability: exact resume after SIGKILL, kills inside a checkpoint write, one-line errors with exit code 2,
skipped updates, safe loading. The resume tests run train.py in subprocesses on the embedded tiny model.

  pytest tests/test_reliability.py -q                          # ~2-3 min on 2 idle CPU cores
  TINY_MODEL=/tmp/model pytest tests/test_reliability.py -q    # another model folder (default data/tiny_model)

"Bit-identical" compares every logged field except timing (`time/*`, `wall_seconds`, `reward/verify_seconds`)
and every tensor of the final weights with torch.equal, on CPU with one thread.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import train
from config import ConfigError, load_config, validate
from replay import ReplayConfig, make_replay
from rollout import Rollouts

REPO = Path(__file__).resolve().parents[1]
MODEL = Path(os.environ.get("TINY_MODEL", REPO / "data" / "tiny_model"))
needs_model = pytest.mark.skipif(
    not (MODEL / "config.json").is_file(), reason=f"no tiny model at {MODEL}: build it with `python -m data.build_tiny_model`"
)
# The tiny config, shrunk to seconds per step. no_answer=-1 gives most groups a reward spread even when the model
# rarely solves a problem, so there are real updates (optimizer state to restore); uniform replay adds a buffer
# and its sampler to restore.
TINY = [
    "--config", "configs/tiny.yaml", f"--model.path={MODEL}", "--rollout.batch_size=16", "--rollout.group_size=4",
    "--rollout.max_new_tokens=24", "--eval.n=8", "--eval.k=1", "--eval.every=0", "--checkpoint.every=2",
    "--checkpoint.keep_last=2", "--reward.no_answer=-1", "--replay.strategy=uniform", "--replay.ratio=0.25",
    "--threads=1", "--wandb.mode=disabled",
]
STEPS = 6
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
TIMING = ("wall_seconds", "reward/verify_seconds")


def run_train(out: Path, *args: str, steps: int = STEPS, python: list[str] | None = None, env: dict | None = None):
    cmd = (python or [sys.executable, "train.py"]) + TINY + [f"--out_dir={out}", f"--max_steps={steps}", *args]
    return subprocess.run(cmd, cwd=REPO, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=600, check=False)


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in TIMING} for r in rows]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_same_run(a: Path, b: Path) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in mb] == list(range(1, STEPS + 1))  # every step once: nothing duplicated, nothing lost
    assert json.dumps(ma) == json.dumps(mb)  # as text, so that NaN fields compare equal
    wa, wb = weights(a / "final"), weights(b / "final")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    sa.pop("wall_seconds"), sb.pop("wall_seconds")
    assert json.dumps(sa) == json.dumps(sb)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must reproduce."""
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {MODEL}")
    out = tmp_path_factory.mktemp("ref") / "run"
    r = run_train(out)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    # Resumes start from the step-2 or step-4 checkpoint: both must carry optimizer state for the test to mean anything.
    assert m[1]["skipped/zero_adv"] < 2, "no optimizer step before the step-2 checkpoint"
    assert m[-1]["skipped/zero_adv"] - m[1]["skipped/zero_adv"] < STEPS - 2, "no optimizer step after step 2"
    assert not all(torch.equal(v, weights(MODEL)[k]) for k, v in weights(out / "final").items())
    return out


# ------------------------------------------------------------------------------------------------ resume


@needs_model
def test_sigkill_mid_run_then_resume_is_bit_identical(reference, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py"] + TINY + [f"--out_dir={out}", f"--max_steps={STEPS}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / "metrics.jsonl"
    deadline = time.time() + 300
    # Kill once step 3 is logged: after the step-2 checkpoint, in the middle of step 4 (or its checkpoint).
    while proc.poll() is None and time.time() < deadline:
        if log.exists() and '"step": 3,' in log.read_text():
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (out / "final").exists()
    r = run_train(out, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr
    assert_same_run(reference, out)


# Runs train.main with torch.save / os.replace patched to die (os._exit, as abrupt as SIGKILL) at one exact point
# of the step-4 checkpoint: while trainer_state.pt is half written, or after the folder is renamed into place but
# before `latest` points to it. A test-only wrapper: train.py itself has no crash hooks.
CRASH = """
import io, os, sys, torch
import train
at, real_save, real_replace = os.environ["CRASH_AT"], torch.save, os.replace
def save(obj, f, *a, **k):
    if at == "writing" and str(f).endswith(".tmp_step_000004/trainer_state.pt"):
        buf = io.BytesIO(); real_save(obj, buf)
        open(f, "wb").write(buf.getvalue()[: len(buf.getvalue()) // 2]); os._exit(137)
    return real_save(obj, f, *a, **k)
def replace(src, dst):
    if at == "renamed" and str(dst).endswith("checkpoints/latest") and open(src).read() == "step_000004":
        os._exit(137)
    return real_replace(src, dst)
torch.save, os.replace = save, replace
sys.exit(train.main(sys.argv[1:]))
"""


@needs_model
@pytest.mark.parametrize("at", ["writing", "renamed"])
def test_kill_inside_checkpoint_write_resumes_from_previous(reference, tmp_path, at):
    out = tmp_path / "run"
    r = run_train(out, python=[sys.executable, "-c", CRASH], env={"CRASH_AT": at})
    assert r.returncode == 137, r.stderr[-3000:]
    ck = out / "checkpoints"
    assert (ck / "latest").read_text() == "step_000002"
    if at == "writing":
        assert (ck / ".tmp_step_000004" / "model.safetensors").exists() and not (ck / "step_000004").exists()
    else:
        assert (ck / "step_000004" / "trainer_state.pt").exists()
    with open(out / "metrics.jsonl", "a") as f:  # as if the kill had also cut a log line in half
        f.write('{"step": 5, "reward_me')
    r = run_train(out, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step_000002 (step 2)" in r.stderr
    assert not list(ck.glob(".tmp_*")) and (ck / "latest").read_text() == "step_000004"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_000002", "step_000004"]  # keep_last=2
    assert_same_run(reference, out)


@needs_model
def test_resume_continues_the_same_wandb_run(tmp_path):
    out = tmp_path / "run"
    r = run_train(out, "--wandb.mode=offline", steps=3)
    assert r.returncode == 0, r.stderr[-3000:]
    run_id = torch.load(out / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=True)["wandb_id"]
    assert run_id
    r = run_train(out, "--wandb.mode=offline", "--resume", steps=3)  # redo step 3 from the step-2 checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(run_id) for name in runs)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_rng_and_replay_state_load_with_weights_only(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    s = train.rng_state()
    before = (random.random(), np.random.rand(), torch.rand(1))
    cfg = ReplayConfig(strategy="aper", capacity=8)
    buf = make_replay(cfg, max_len=6, pad_id=0, seed=0)
    B = 4
    rows = Rollouts(
        tokens=torch.arange(B * 6).view(B, 6), prompt_len=torch.full((B,), 2), seq_len=torch.full((B,), 6),
        behav_logp=-torch.rand(B, 6), truncated=torch.zeros(B, dtype=torch.bool), prompt_idx=torch.arange(B),
        group=torch.tensor([0, 0, 1, 1]), born=torch.zeros(B, dtype=torch.long), reward=torch.tensor([1.0, 0, 1, 0]),
        correct=torch.tensor([True, False, True, False]), advantage=torch.tensor([0.7, -0.7, 0.7, -0.7]),
        entropy=torch.rand(B), replayed=torch.zeros(B, dtype=torch.bool), onpolicy=torch.ones(B, dtype=torch.bool),
    )
    buf.push(rows, step=0)
    torch.save({"rng": s, "replay": buf.state_dict()}, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)  # raises on anything but tensors and plain types
    train.set_rng_state(loaded["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == before
    again = make_replay(cfg, max_len=6, pad_id=0, seed=0)
    again.load_state_dict(loaded["replay"])
    assert len(again) == len(buf) == 4 and torch.equal(again.tokens, buf.tokens)


class _Fake:
    """Stands in for the model, tokenizer, optimizer, scheduler and replay buffer that save_checkpoint writes."""

    def save_pretrained(self, folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"weights")

    def state_dict(self):
        return {"x": torch.zeros(2)}


def test_checkpoint_keep_last_and_full_disk(tmp_path, monkeypatch):
    f, ck = _Fake(), tmp_path / "checkpoints"
    for step in (2, 4, 6):
        train.save_checkpoint(tmp_path, step, f, f, f, f, f, {"step": step}, keep_last=2)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000004", "step_000006"]
    assert torch.load(ck / "step_000006" / "trainer_state.pt", weights_only=True)["step"] == 6

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(train.RunError, match=r"step_000008 could not be written \(No space left on device\); step_000006 is intact"):
        train.save_checkpoint(tmp_path, 8, f, f, f, f, f, {"step": 8}, keep_last=2)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000004", "step_000006"]  # temporary folder removed
    assert (ck / "latest").read_text() == "step_000006"


# --------------------------------------------------------------------------------------- skipped updates


def test_skip_reason():
    ok = torch.tensor(0.5)
    assert train.skip_reason(True, 0.1, ok) is None
    assert train.skip_reason(False, 0.0, torch.tensor(0.0)) == "zero_adv"
    assert train.skip_reason(True, float("nan"), ok) == "nonfinite"
    assert train.skip_reason(True, float("inf"), ok) == "nonfinite"
    assert train.skip_reason(True, 0.1, torch.tensor(float("nan"))) == "nonfinite"
    assert train.skip_reason(True, 0.1, torch.tensor(float("inf"))) == "nonfinite"


def run_in_process(out: Path, *args: str, steps: int = 2) -> list[dict]:
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), TINY[2:] + [f"--out_dir={out}", f"--max_steps={steps}", *args])
    validate(cfg)
    train.train(cfg)
    return metrics(out)


@needs_model
def test_all_zero_advantages_skip_every_update(tmp_path):
    m = run_in_process(tmp_path / "run", "--reward.correct=0", "--reward.wrong=0", "--reward.no_answer=0")
    assert [r["skipped/zero_adv"] for r in m] == [1, 2] and m[-1]["skipped/nonfinite"] == 0
    w0, w1 = weights(MODEL), weights(tmp_path / "run" / "final")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@needs_model
def test_nonfinite_loss_skips_the_update(tmp_path, monkeypatch):
    # Every group gets a nonzero advantage and every loss is NaN: each step must be skipped, weights untouched.
    real_adv, real_loss = train.grpo.group_advantages, train.grpo.policy_loss

    def shifted_advantages(*args, **kwargs):
        adv, m = real_adv(*args, **kwargs)
        return adv + 1.0, m

    def nan_loss(*args, **kwargs):
        loss, m = real_loss(*args, **kwargs)
        return loss * float("nan"), m

    monkeypatch.setattr(train.grpo, "group_advantages", shifted_advantages)
    monkeypatch.setattr(train.grpo, "policy_loss", nan_loss)
    m = run_in_process(tmp_path / "run")
    assert [r["skipped/nonfinite"] for r in m] == [1, 2] and m[-1]["skipped/zero_adv"] == 0
    w0, w1 = weights(MODEL), weights(tmp_path / "run" / "final")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


# ------------------------------------------------------------------------------------------- bad input


def _bad_jsonl(tmp: Path) -> str:
    f = tmp / "train.jsonl"
    f.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": "4"}\n{"problem": "3+3", "answer": \n')
    return f"--data.train={f}"


def _empty_jsonl(tmp: Path) -> str:
    f = tmp / "empty.jsonl"
    f.write_text("\n")
    return f"--data.train={f}"


# (case id, extra arguments (a function of tmp_path when it needs a file), expected message)
BAD = [
    ("unknown key", ["--optim.lrr=1e-3"], "unknown config key optim.lrr; did you mean optim.lr?"),
    ("wrong type", ["--rollout.group_size=four"], "config key rollout.group_size expects int, got 'four'"),
    ("missing config file", ["--config", "configs/no_such.yaml"], "config file not found: configs/no_such.yaml"),
    ("missing model path", ["--model.path=/no/such/model"], "model.path /no/such/model does not exist"),
    ("missing relative model path", ["--model.path=data/no_such_model"], "model.path data/no_such_model does not exist"),
    ("malformed JSONL line", lambda t: [_bad_jsonl(t)], "train.jsonl:3: malformed JSON"),
    ("empty dataset", lambda t: [_empty_jsonl(t)], "empty.jsonl: no problems found (empty dataset)"),
    ("group size 1", ["--rollout.group_size=1"], "rollout.group_size must be ≥ 2"),
    ("batch not divisible", ["--rollout.batch_size=10"], "rollout.batch_size (10) must be a positive multiple of rollout.group_size (4)"),
    ("max_new_tokens 0", ["--rollout.max_new_tokens=0"], "rollout.max_new_tokens must be > 0, got 0"),
    ("negative lr", ["--optim.lr=-1e-3"], "optim.lr must be > 0, got -0.001"),
    ("replay ratio", ["--replay.strategy=uniform", "--replay.ratio=1.5"], "replay.ratio must be in [0, 1) for uniform"),
    ("aper ratio", ["--replay.strategy=aper", "--replay.ratio=-1"], "replay.ratio must be in [0, 4] for aper"),
    ("tau_max 0", ["--replay.strategy=aper", "--replay.tau_max=0"], "replay.tau_max must be ≥ 1, got 0"),
    ("--config without a file", ["--config"], "--config needs a file"),
]


def _previous_run(out: Path) -> dict[str, bytes]:
    """A finished-looking run in `out`; returns its files so the test can check none changed."""
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step_000002")
    (out / "checkpoints" / "step_000002" / "trainer_state.pt").write_bytes(b"weights of a week-long run")
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    return snapshot(out)


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def error_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("case, extra, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line_exit_2_nothing_overwritten(tmp_path, capsys, case, extra, message):
    # --overwrite on a previous run: the worst case, since a valid command would delete it.
    out = tmp_path / "run"
    before = _previous_run(out)
    extra = extra(tmp_path) if callable(extra) else extra
    argv = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={MODEL}", f"--out_dir={out}", "--overwrite",
            "--threads=1", "--wandb.mode=disabled", "--rollout.group_size=4", "--rollout.batch_size=16", *extra]
    if case.startswith(("malformed", "empty")) and not (MODEL / "config.json").is_file():
        pytest.skip("needs the tiny model")
    assert train.main(argv) == 2
    assert message in error_line(capsys)
    assert snapshot(out) == before


def test_non_empty_out_dir_needs_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    before = _previous_run(out)
    assert train.main(["--config", str(REPO / "configs" / "tiny.yaml"), f"--out_dir={out}", "--wandb.mode=disabled"]) == 2
    assert f"out_dir {out} is not empty; pass --resume to continue it or --overwrite to start over" in error_line(capsys)
    assert snapshot(out) == before


def test_resume_without_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert train.main(["--config", str(REPO / "configs" / "tiny.yaml"), f"--out_dir={out}", "--resume"]) == 2
    assert f"--resume: no complete checkpoint in {out / 'checkpoints'}" in error_line(capsys)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_unwritable_out_dir(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert train.main(["--config", str(REPO / "configs" / "tiny.yaml"), f"--out_dir={blocker / 'run'}"]) == 2
    assert f"out_dir {blocker / 'run'} is not writable" in error_line(capsys)
    assert blocker.read_text() == "not a folder"
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert train.main(["--config", str(REPO / "configs" / "tiny.yaml"), f"--out_dir={locked / 'run'}"]) == 2
        assert "is not writable: Permission denied" in error_line(capsys)


def test_debug_shows_the_traceback():
    with pytest.raises(ConfigError, match="unknown config key optim.lrr"):
        train.main(["--optim.lrr=1", "--debug"])


def test_exit_code_and_single_line_from_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml", "--optim.lr=-1", f"--out_dir={tmp_path / 'x'}"],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr == "error: optim.lr must be > 0, got -1.0\n"
    assert not (tmp_path / "x").exists()


class _Payload:
    """Unpickling this runs a shell command: what a tampered checkpoint could carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@needs_model
def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "pwned"
    _previous_run(out)
    torch.save({"step": 2, "evil": _Payload(marker)}, out / "checkpoints" / "step_000002" / "trainer_state.pt")
    before = snapshot(out)
    argv = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={MODEL}", f"--out_dir={out}", "--resume", "--threads=1"]
    assert train.main(argv) == 2
    assert "step_000002: holds objects other than tensors and plain values" in error_line(capsys)
    assert not marker.exists()  # torch.load(weights_only=True) refused the payload
    assert snapshot(out) == before


@needs_model
def test_model_folder_code_does_not_run_by_default(tmp_path):
    # A model folder that ships its own modeling code: with trust_remote_code off (the default) it must not be imported.
    folder, marker = tmp_path / "model", tmp_path / "pwned"
    folder.mkdir()
    for f in MODEL.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    argv = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={folder}", f"--out_dir={tmp_path / 'run'}",
            "--max_steps=0", "--eval.n=2", "--eval.k=1", "--threads=1", "--wandb.mode=disabled"]
    train.main(argv)  # the built-in Qwen2 class loads the weights, or the load is refused with one line: either is safe
    assert not marker.exists()
