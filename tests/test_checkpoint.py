"""The run's checkpoints and folder (support/checkpoint.py, rundir.py, integrity.py): exact resume
after SIGKILL and SIGTERM, kills and full disks inside checkpoint writes, damaged files, --overwrite
that never removes what a run did not write, one-line errors with exit code 2 and nothing lost,
locks, skipped updates, safe loading. The resume tests run train.py in subprocesses on the
embedded tiny model.

  pytest tests/test_checkpoint.py -q                        # ~3 min on 2 idle CPU cores
  TINY_MODEL=/tmp/model pytest tests/test_checkpoint.py -q  # another model folder
                                                               (default data/tiny_model)

"Bit-identical" compares every logged field except timing (`time/*`, `wall_seconds`,
`reward/verify_seconds`) and every tensor of the final weights with torch.equal, on CPU with one
thread.
"""

import errno
import fcntl
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
from fixtures import previous_run, snapshot, train_here
from safetensors import SafetensorError
from safetensors.torch import load_file

import train
from support.checkpoint import checkpoints
from config import load_config, validate
from config import get_lr
from replay import ReplayConfig, make_replay
from batch import Rollouts
from support import checkpoint
from support.models import load_pretrained, save_model
from support.preempt import rng_state, set_rng_state
from support.util import oneline

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = Path(os.environ.get("TINY_MODEL", REPO / "data" / "tiny_model"))
needs_model = pytest.mark.skipif(
    not (MODEL / "config.json").is_file(),
    reason=f"no tiny model at {MODEL}: build it with `python -m data.build_tiny_model`",
)
# The tiny config, shrunk to seconds per step. no_answer=-1 gives most groups a reward spread even
# when the model rarely solves a problem, so there are real updates (optimizer state to restore);
# uniform replay adds a buffer and its sampler to restore.
TINY = [
    "--config", "configs/tiny.yaml", f"--model.path={MODEL}", "--rollout.batch_size=16",
    "--rollout.group_size=4", "--rollout.max_new_tokens=24", "--eval.n=8", "--eval.k=1",
    "--eval.every=0", "--checkpoint.every=2", "--checkpoint.keep_last=2",
    "--reward.no_answer=-1", "--replay.strategy=uniform", "--replay.ratio=0.25",
    "--threads=1", "--wandb.mode=disabled",
]
STEPS = 6
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true",
       "TOKENIZERS_PARALLELISM": "false"}
TIMING = ("wall_seconds", "reward/verify_seconds")


def run_train(out: Path, *args: str, steps: int = STEPS, python: list[str] | None = None,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """train.py (TINY, `steps` steps, `args`) into `out`: in this process (fixtures.train_here), or
    given `python` (the command before the arguments) or `env`, in a subprocess."""
    argv = TINY + [f"--out_dir={out}", f"--max_steps={steps}", *args]
    if python is None and env is None:
        return train_here(*argv)
    cmd = (python or [sys.executable, "train.py"]) + argv
    return subprocess.run(cmd, cwd=REPO, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=600, check=False)


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in TIMING}
            for r in rows]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")



def kill_after_step_then_resume(out: Path, args: tuple, step: int = 3):
    """train.py (TINY, 6 steps, `args`) into `out`, SIGKILLed once `step` lines are logged, then
    resumed with --resume: the resumed run's process (it must exit 0)."""
    cmd = [sys.executable, "train.py", *TINY, f"--out_dir={out}", "--max_steps=6", *args]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, **quiet)
    if wait_for_step(proc, out / "metrics.jsonl", step):
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    r = run_train(out, "--resume", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r

def assert_same_run(a: Path, b: Path) -> None:
    ma, mb = metrics(a), metrics(b)
    # every step once: nothing duplicated, nothing lost
    assert [r["step"] for r in mb] == list(range(1, STEPS + 1))
    assert json.dumps(ma) == json.dumps(mb)  # as text, so that NaN fields compare equal
    wa, wb = weights(a / "final"), weights(b / "final")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    sa.pop("wall_seconds"), sb.pop("wall_seconds")
    assert json.dumps(sa) == json.dumps(sb)


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must reproduce."""
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {MODEL}")
    out = tmp_path_factory.mktemp("ref") / "run"
    r = run_train(out)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    # Resumes start from the step-2 or step-4 checkpoint: both must carry optimizer state for the
    # test to mean anything.
    assert m[1]["skipped/zero_adv"] < 2, "no optimizer step before the step-2 checkpoint"
    assert m[-1]["skipped/zero_adv"] - m[1]["skipped/zero_adv"] < STEPS - 2, (
        "no optimizer step after step 2")
    assert not all(torch.equal(v, weights(MODEL)[k]) for k, v in weights(out / "final").items())
    return out


def wait_for_step(proc: subprocess.Popen, log: Path, step: int) -> bool:
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if log.exists() and f'"step": {step},' in log.read_text():
            return True
        time.sleep(0.01)
    return False


# ---------------------------------------------------------------------------------------- resume


@needs_model
def test_sigkill_mid_run_then_resume_is_bit_identical(reference, tmp_path):
    out = tmp_path / "run"
    cmd = ([sys.executable, "train.py"] + TINY
           + [f"--out_dir={out}", f"--max_steps={STEPS}"])
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    # Kill once step 3 is logged: after the step-2 checkpoint, in the middle of step 4 (or its
    # checkpoint).
    if wait_for_step(proc, out / "metrics.jsonl", 3):
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (out / "final").exists()
    r = run_train(out, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr
    assert_same_run(reference, out)


@needs_model
def test_sigterm_checkpoints_the_current_step_and_resume_is_bit_identical(reference, tmp_path):
    """Preemption: SIGTERM finishes (or abandons) the step under way, writes a checkpoint there,
    says where to resume and exits 143; resuming from it reproduces the uninterrupted run."""
    out = tmp_path / "run"
    cmd = ([sys.executable, "train.py"] + TINY
           + [f"--out_dir={out}", f"--max_steps={STEPS}", "--checkpoint.every=0"])
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert wait_for_step(proc, out / "metrics.jsonl", 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    err = proc.stderr.read()
    assert ("Traceback" not in err
            and "stopped by SIGTERM after step" in err
            and "--resume" in err), err[-2000:]
    step = len(metrics(out))
    assert 3 <= step < STEPS and [p.name for p in checkpoints(out)] == [f"step_{step:06d}"]
    r = run_train(out, "--resume", "--checkpoint.every=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(reference, out)


@needs_model
def test_sigint_stops_with_one_line(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py"] + TINY + [f"--out_dir={out}", "--max_steps=50"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert wait_for_step(proc, out / "metrics.jsonl", 2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    err = proc.stderr.read()
    assert ("Traceback" not in err
            and "stopped by SIGINT after step" in err
            and "--resume continues from step_000002" in err)


# Runs train.main with torch.save / os.replace patched to die (os._exit, as abrupt as SIGKILL) at
# one exact point of the step-4 checkpoint: while a state file is half written, or right after the
# folder is renamed into place.
# A test-only wrapper: train.py itself has no crash hooks.
CRASH = """
import io, os, sys, torch
import train
at, real_save, real_replace = os.environ["CRASH_AT"], torch.save, os.replace
def save(obj, f, *a, **k):
    if at == "writing" and str(f).endswith(".tmp_step_000004/state_rank0.pt"):
        buf = io.BytesIO(); real_save(obj, buf)
        open(f, "wb").write(buf.getvalue()[: len(buf.getvalue()) // 2]); os._exit(137)
    return real_save(obj, f, *a, **k)
def replace(src, dst):
    real_replace(src, dst)
    if at == "renamed" and str(dst).endswith("checkpoints/step_000004"):
        os._exit(137)
torch.save, os.replace = save, replace
sys.exit(train.main(sys.argv[1:]))
"""


@needs_model
@pytest.mark.parametrize("at", ["writing", "renamed"])
def test_kill_inside_checkpoint_write_resumes_from_the_newest_complete(reference, tmp_path, at):
    out = tmp_path / "run"
    r = run_train(out, python=[sys.executable, "-c", CRASH], env={"CRASH_AT": at})
    assert r.returncode == 137, r.stderr[-3000:]
    ck = out / "checkpoints"
    if at == "writing":
        assert ((ck / ".tmp_step_000004" / "model.safetensors").exists()
                and not (ck / "step_000004").exists())
    else:
        assert (ck / "step_000004" / "state_rank0.pt").exists()
    with open(out / "metrics.jsonl", "a") as f:  # as if the kill had also cut a log line in half
        f.write('{"step": 5, "reward_me')
    r = run_train(out, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("step_000002 (step 2)" if at == "writing" else "step_000004 (step 4)") in r.stderr
    assert not list(ck.glob(".tmp_*"))
    # keep_last=2, the end saved
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_000004", "step_000006"]
    assert_same_run(reference, out)


@needs_model
def test_resume_continues_the_same_wandb_run(tmp_path):
    out = tmp_path / "run"
    r = run_train(out, "--wandb.mode=offline", steps=3)
    assert r.returncode == 0, r.stderr[-3000:]
    run_id = torch.load(out / "checkpoints" / "step_000002" / "state_rank0.pt",
                        weights_only=True)["run"]["wandb_id"]
    assert run_id
    # redo step 3 from the step-2 checkpoint
    r = run_train(out, "--wandb.mode=offline", "--resume", steps=3)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(run_id) for name in runs)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_a_run_resumed_past_its_end_is_unfinished_until_its_new_end(tmp_path, monkeypatch):
    """A finished run resumed with a larger max_steps (#60's continuation): once its first new
    checkpoint puts the resume's files in place, the old end's summary.json is gone, so a run that
    fails after it is not taken for a finished one (a reproduction would skip it, keep_runs keep
    it); the new end writes summary.json of its own last step."""
    out = tmp_path / "run"
    assert run_train(out, steps=4).returncode == 0
    real = train.record_step

    def failing(r, step, *args):  # step 7 fails, after step 6's checkpoint
        if step == 6:
            raise RuntimeError("injected")
        return real(r, step, *args)

    monkeypatch.setattr(train, "record_step", failing)
    with pytest.raises(RuntimeError, match="injected"):
        run_train(out, "--resume", steps=8)
    assert not (out / "summary.json").exists()
    assert [row["step"] for row in metrics(out)] == [1, 2, 3, 4, 5, 6]
    monkeypatch.undo()
    assert run_train(out, "--resume", steps=8).returncode == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 8
    assert [row["step"] for row in metrics(out)] == list(range(1, 9))
    assert run_train(out, "--resume", steps=8).returncode == 0  # no step left: the end again
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_rng_and_replay_state_load_with_weights_only(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    s = rng_state()
    before = (random.random(), np.random.rand(), torch.rand(1))
    cfg = ReplayConfig(strategy="aper", capacity=8)
    buf = make_replay(cfg, max_len=6, pad_id=0, seed=0)
    B = 4
    rows = Rollouts(
        tokens=torch.arange(B * 6).view(B, 6),
        prompt_len=torch.full((B,), 2),
        seq_len=torch.full((B,), 6),
        behav_logp=-torch.rand(B, 6),
        truncated=torch.zeros(B, dtype=torch.bool),
        prompt_idx=torch.arange(B),
        group=torch.tensor([0, 0, 1, 1]),
        born=torch.zeros(B, dtype=torch.long),
        reward=torch.tensor([1.0, 0, 1, 0]),
        correct=torch.tensor([True, False, True, False]),
        advantage=torch.tensor([0.7, -0.7, 0.7, -0.7]),
        entropy=torch.rand(B),
        replayed=torch.zeros(B, dtype=torch.bool),
        onpolicy=torch.ones(B, dtype=torch.bool),
        slot=torch.full((B,), -1),
    )
    buf.push(rows, 0, torch.zeros(B))
    torch.save({"rng": s, "replay": buf.state_dict()}, tmp_path / "state.pt")
    # raises on anything but tensors and plain types
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    set_rng_state(loaded["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == before
    again = make_replay(cfg, max_len=6, pad_id=0, seed=0)
    again.load_state_dict(loaded["replay"])
    assert len(again) == len(buf) == 4 and torch.equal(again.rows.tokens, buf.rows.tokens)


# ------------------------------------------------------------------------------ full disks, damage


@pytest.fixture(scope="module")
def tiny():
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {MODEL}")
    return load_pretrained(str(MODEL))


FULL_DISK = {
    "SafetensorError": SafetensorError(
        "Error while serializing: IoError(No space left on device)"),
    "RuntimeError": RuntimeError(
        "[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file"),
    "OSError": OSError(errno.ENOSPC, "No space left on device"),
}


@pytest.mark.parametrize("error", list(FULL_DISK))
@pytest.mark.parametrize("writer", ["weights", "state"])
def test_full_disk_during_a_checkpoint_is_one_line_and_leaves_nothing_behind(
        tmp_path, monkeypatch, tiny, writer, error):
    model, tok = tiny
    ck = tmp_path / "checkpoints"
    save_model(model, tok, ck / "step_000002", {"step": 2})

    def full_disk(*args, **kwargs):
        raise FULL_DISK[error]

    target = ("transformers.modeling_utils.safe_save_file" if writer == "weights" else "torch.save")
    monkeypatch.setattr(target, full_disk)
    with pytest.raises(OSError) as e:  # train() turns it into one line naming what is intact
        save_model(model, tok, ck / "step_000004", {"step": 4})
    msg = oneline(e.value)
    assert f"{ck / 'step_000004'} could not be written ({error}" in msg
    assert f"{ck / 'step_000002'} is intact" in checkpoint.intact(tmp_path)
    assert sorted(p.name for p in ck.iterdir()) == ["step_000002"]  # the temporary folder is gone
    assert (ck / "step_000002" / "model.safetensors").stat().st_size > 0


@needs_model
def test_full_disk_at_the_final_save_is_one_line(tmp_path, capsys, monkeypatch):
    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", full_disk)
    out = tmp_path / "run"
    assert train.main(TINY + [f"--out_dir={out}", "--max_steps=1", "--checkpoint.every=0"]) == 2
    assert f"{out / 'final'} could not be written (SafetensorError" in error_line(capsys)
    assert not (out / "final").exists() and not (out / ".tmp_final").exists()


@needs_model
def test_checkpoint_files_are_fsynced_before_the_rename(tmp_path, monkeypatch, tiny):
    model, tok = tiny
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync",
        lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    monkeypatch.setattr(
        os, "replace",
        lambda a, b: renamed.append((str(a), len(synced))) or real_replace(a, b))
    save_model(model, tok, tmp_path / "step_000001", {"step": 1})
    (_, n_synced_before), = [x for x in renamed if x[0].endswith(".tmp_step_000001")]
    files = {p.name for p in (tmp_path / "step_000001").iterdir()}
    assert {"model.safetensors", "state_rank0.pt", "config.json"} <= files
    # every file, before the folder is renamed
    assert {Path(f).name for f in synced[:n_synced_before]} >= files
    assert str(tmp_path) in synced[n_synced_before:]  # and the parent folder after


def damage(ck: Path, how: str) -> None:
    if how == "truncated weights":
        data = (ck / "model.safetensors").read_bytes()
        (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "empty state":
        (ck / "state_rank0.pt").write_bytes(b"")
    elif how == "state without keys":
        torch.save({"step": 4}, ck / "state_rank0.pt")


@needs_model
@pytest.mark.parametrize("how", ["truncated weights", "empty state", "state without keys"])
def test_damaged_latest_checkpoint_names_the_newest_intact_one(reference, tmp_path, capsys, how):
    out = tmp_path / "run"
    r = run_train(out, "--checkpoint.keep_last=3", steps=4)
    assert r.returncode == 0, r.stderr[-3000:]
    damage(out / "checkpoints" / "step_000004", how)
    before = snapshot(out)
    argv = TINY + [f"--out_dir={out}", "--max_steps=6", "--resume"]
    assert train.main(argv) == 2
    line = error_line(capsys)
    assert ("checkpoint step_000004 is damaged" in line
            and "the newest intact one is step_000002: --resume=step_000002" in line)
    assert snapshot(out) == before
    # and from there the run ends as the reference does
    assert train.main(argv[:-1] + ["--resume=step_000002"]) == 0
    assert_same_run(reference, out)


@needs_model
def test_damaged_checkpoints_name_the_newest_intact_not_the_oldest(tmp_path, capsys):
    """Guards the suggestion after a damaged checkpoint with three kept (steps 2, 4, 6): step 6
    damaged names step 4 (the newest intact, not the oldest); steps 6 and 4 damaged name step 2
    (not the damaged step 4)."""
    out = tmp_path / "run"
    r = run_train(out, "--checkpoint.keep_last=3", steps=6)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.glob("step_*")) == [f"step_00000{n}" for n in (2, 4, 6)]
    argv = TINY + [f"--out_dir={out}", "--max_steps=8", "--resume"]
    damage(ck / "step_000006", "empty state")
    assert train.main(argv) == 2
    line = error_line(capsys)
    assert "the newest intact one is step_000004: --resume=step_000004" in line, line
    damage(ck / "step_000004", "truncated weights")
    assert train.main(argv) == 2
    line = error_line(capsys)
    assert "the newest intact one is step_000002: --resume=step_000002" in line, line


@needs_model
def test_truncated_model_file_is_one_line(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in MODEL.iterdir():
        (folder / f.name).write_bytes(f.read_bytes()[: 1000] if f.name == "model.safetensors"
                                      else f.read_bytes())
    assert train.main(TINY + [f"--model.path={folder}", f"--out_dir={tmp_path / 'run'}",
                              "--max_steps=1"]) == 2
    assert f"model.path {folder}: " in error_line(capsys)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------- skipped updates


def run_in_process(out: Path, *args: str, steps: int = 2) -> list[dict]:
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"),
                      TINY[2:] + [f"--out_dir={out}", f"--max_steps={steps}", *args])
    validate(cfg)
    assert train.train(cfg) == 0
    return metrics(out)


@pytest.mark.fast  # (#59: the fast tier's catch of a loop that skips the methods' observe)
@needs_model
def test_the_methods_that_learn_from_a_rollout_see_each_one(tmp_path):
    """GRESO's prompt skipping and staged rollouts learn from each step's final rollout (train.py
    calls their observe): after two steps the checkpoint holds GRESO's visits of the prompts it
    saw and stages' stored successes (the tiny model solves some problems in every step)."""
    out = tmp_path / "run"
    run_in_process(out, "--skip.enabled=true", "--stages.first=2", "--checkpoint.every=1")
    state = torch.load(out / "checkpoints" / "step_000002" / "state_rank0.pt", weights_only=True)
    assert int(state["skip"]["visits"].sum()) > 0
    assert len(state["stages"]["prompts"]) > 0


@needs_model
def test_only_train_py_writes_the_progress(tmp_path, monkeypatch):
    """#57: the run's progress (train.Progress, what a checkpoint saves) is written by train.py
    alone: every field set outside its construction, in a run with an eval and a checkpoint each
    step, a wandb run (offline) and a --resume, is set by code in train.py."""
    writers = set()
    real = train.Progress.__setattr__

    def recording(self, name, value):
        caller = sys._getframe(1).f_code
        if caller.co_name != "__init__":  # (the dataclass's own, under replace() too)
            writers.add(Path(caller.co_filename).name)
        real(self, name, value)

    monkeypatch.setattr(train.Progress, "__setattr__", recording)
    out = tmp_path / "run"
    args = ["--checkpoint.every=1", "--eval.every=1", "--wandb.mode=offline"]
    run_in_process(out, *args)
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"),
                      TINY[2:] + [f"--out_dir={out}", "--max_steps=3", *args])
    assert train.train(cfg, resume="") == 0
    assert len(metrics(out)) == 3
    assert writers == {"train.py"}, writers


@pytest.mark.fast  # (the fast tier's only catch of an optimizer step without signal: #59)
@needs_model
def test_all_zero_advantages_skip_every_update(tmp_path):
    """No update when no advantage is non-zero; the learning rate each step is get_lr's (the
    warm-up's: a constant rate would not be)."""
    m = run_in_process(tmp_path / "run", "--reward.correct=0", "--reward.wrong=0",
                       "--reward.no_answer=0")
    assert [r["skipped/zero_adv"] for r in m] == [1, 2] and m[-1]["skipped/nonfinite"] == 0
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), TINY[2:] + ["--max_steps=2"])
    assert [r["lr"] for r in m] == [get_lr(0, cfg), get_lr(1, cfg)] != [cfg.optim.lr] * 2
    w0, w1 = weights(MODEL), weights(tmp_path / "run" / "final")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@needs_model
def test_nonfinite_loss_skips_the_update(tmp_path, monkeypatch):
    # Every group gets a nonzero advantage and every loss is NaN: each step must be skipped, weights
    # untouched.
    real_adv, real_loss = train.grpo.group_advantages, train.grpo.policy_loss

    def shifted_advantages(*args, **kwargs):
        adv, m = real_adv(*args, **kwargs)
        return adv + 1.0, m

    def nan_loss(*args, **kwargs):
        loss, m = real_loss(*args, **kwargs)
        return loss * float("nan"), m | {"loss": m["loss"] * float("nan")}

    monkeypatch.setattr(train.grpo, "group_advantages", shifted_advantages)
    monkeypatch.setattr(train.grpo, "policy_loss", nan_loss)
    m = run_in_process(tmp_path / "run")
    assert [r["skipped/nonfinite"] for r in m] == [1, 2] and m[-1]["skipped/zero_adv"] == 0
    w0, w1 = weights(MODEL), weights(tmp_path / "run" / "final")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@needs_model
def test_nonfinite_weights_stop_the_run_with_one_line(tmp_path, capsys, monkeypatch):
    """A finite loss and gradient can still leave inf weights (a huge lr): the run stops at once,
    naming the step and the last good checkpoint, before generate ever meets NaN probabilities."""
    real_step = torch.optim.AdamW.step

    def step_to_inf(self, *a, **k):
        out = real_step(self, *a, **k)
        if train_step[0] >= 2:
            self.param_groups[0]["params"][0].data.fill_(float("inf"))
        train_step[0] += 1
        return out

    train_step = [0]
    monkeypatch.setattr(torch.optim.AdamW, "step", step_to_inf)
    out = tmp_path / "run"
    assert train.main(TINY + [f"--out_dir={out}", "--max_steps=6"]) == 2
    line = error_line(capsys)
    assert "non-finite weights after the optimizer step at step" in line
    assert "the last good checkpoint is step_000002: --resume=step_000002" in line


# --------------------------------------------------------------------------------------- bad input


def _bad_jsonl(tmp: Path) -> str:
    f = tmp / "train.jsonl"
    f.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": "4"}\n'
                 '{"problem": "3+3", "answer": \n')
    return f"--data.train={f}"


def _empty_jsonl(tmp: Path) -> str:
    f = tmp / "empty.jsonl"
    f.write_text("\n")
    return f"--data.train={f}"


def _bad_gold(value: str):
    def make(tmp: Path) -> list[str]:
        f = tmp / "gold.jsonl"
        f.write_text('{"problem": "1+1", "answer": "2"}\n'
                     + f'{{"problem": "2+2", "answer": {value}}}\n')
        return [f"--data.train={f}"]
    return make


def _long_prompts(tmp: Path) -> list[str]:
    f = tmp / "long.jsonl"
    f.write_text(json.dumps({"problem": "1+" * 2_500_000 + "1", "answer": "2500001"}) + "\n")
    return [f"--data.train={f}"]


# (case id, extra arguments (or a function of tmp_path), expected message). Each must fail before
# anything changes.
BAD = [
    ("unknown key", ["--optim.lrr=1e-3"], "unknown config key optim.lrr; did you mean optim.lr?"),
    ("wrong type", ["--rollout.group_size=four"],
     "config key rollout.group_size expects int, got 'four'"),
    ("missing config file", ["--config", "configs/no_such.yaml"],
     "config file not found: configs/no_such.yaml"),
    ("missing model path", ["--model.path=/no/such/model"],
     "model.path /no/such/model does not exist"),
    ("missing relative model path", ["--model.path=data/no_such_model"],
     "model.path data/no_such_model does not exist"),
    ("malformed JSONL line", lambda t: [_bad_jsonl(t)], "train.jsonl:3: malformed JSON"),
    ("empty dataset", lambda t: [_empty_jsonl(t)],
     "empty.jsonl: no problems found (empty dataset)"),
    ("null gold answer", _bad_gold("null"), "gold.jsonl: row 1 has no answer field"),
    ("NaN gold answer", _bad_gold("NaN"),
     "gold.jsonl: row 1: the gold answer (answer) must be a non-empty string"),
    ("bool gold answer", _bad_gold("true"),
     "gold.jsonl: row 1: the gold answer (answer) must be a non-empty string"),
    ("list gold answer", _bad_gold("[4]"),
     "gold.jsonl: row 1: the gold answer (answer) must be a non-empty string"),
    ("only over-long prompts", _long_prompts, "every training prompt is over"),
    ("unknown stop token", ["--rollout.stop_tokens=<|no_such|>"],
     "rollout.stop_tokens: '<|no_such|>' is not a single token"),
    ("group size 0", ["--rollout.group_size=0"], "rollout.group_size must be ≥ 2"),
    ("batch not divisible", ["--rollout.batch_size=10"],
     "rollout.batch_size must be a positive multiple of rollout.group_size (4), got 10"),
    ("gen batch 0", ["--rollout.gen_batch_size=0"], "rollout.gen_batch_size must be > 0"),
    ("max_new_tokens 0", ["--rollout.max_new_tokens=0"],
     "rollout.max_new_tokens must be > 0, got 0"),
    ("negative lr", ["--optim.lr=-1e-3"], "optim.lr must be in (0, 1], got -0.001"),
    ("infinite lr", ["--optim.lr=inf"], "optim.lr must be in (0, 1], got inf"),
    ("huge lr", ["--optim.lr=1e30"], "optim.lr must be in (0, 1], got 1e+30"),
    ("threads -1", ["--threads=-1"], "threads must be in [0, 1024]"),
    ("seed -1", ["--seed=-1"], "seed must be in [0, 2^32)"),
    ("template placeholder", ["--data.template=Q: {question}"],
     "data.template must be text containing {problem}"),
    ("tiny train size 0", ["--data.tiny.train_size=0"],
     "data.tiny.train_size must be in [1, 13,041]"),
    ("checkpoint every -1", ["--checkpoint.every=-1"], "checkpoint.every must be ≥ 0"),
    ("verifier timeout 0", ["--reward.timeout=0"], "reward.timeout must be > 0"),
    ("replay ratio", ["--replay.strategy=uniform", "--replay.ratio=1.5"],
     "replay.ratio must be in [0, 1) for uniform"),
    ("aper ratio", ["--replay.strategy=aper", "--replay.ratio=-1"],
     "replay.ratio must be in [0, 4] for aper"),
    ("tau_max 0", ["--replay.strategy=aper", "--replay.tau_max=0"],
     "replay.tau_max must be ≥ 1, got 0"),
    ("--config without a file", ["--config"], "--config needs a file"),
]


def error_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("case, extra, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line_exit_2_nothing_overwritten(tmp_path, capsys, case, extra, message):
    # --overwrite on a previous run: the worst case, since a valid command would set it aside.
    out = tmp_path / "run"
    before = previous_run(out)
    extra = extra(tmp_path) if callable(extra) else extra
    argv = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={MODEL}",
            f"--out_dir={out}", "--overwrite", "--threads=1", "--wandb.mode=disabled",
            "--rollout.group_size=4", "--rollout.batch_size=16", *extra]
    if case in ("malformed JSONL line", "empty dataset", "only over-long prompts",
                "unknown stop token") \
            and not (MODEL / "config.json").is_file():
        pytest.skip("needs the tiny model")
    assert train.main(argv) == 2
    assert message in error_line(capsys)
    assert snapshot(out) == before


@needs_model
def test_overwrite_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    """--overwrite --out_dir=<a git checkout> (or $HOME, or `.`): one line, and every byte, .git
    included, stays."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    (repo / "train.py").write_text("print('my code')\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "add", "."], cwd=repo,
                   check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                   cwd=repo, check=True)
    before = snapshot(repo)
    assert train.main(TINY + [f"--out_dir={repo}", "--overwrite", "--max_steps=1"]) == 2
    assert (f"out_dir {repo} holds files no run wrote (.git, train.py); choose another out_dir"
            in error_line(capsys))
    assert snapshot(repo) == before
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY[:1], str(REPO / TINY[1]),
                        *TINY[2:], "--out_dir=.", "--overwrite", "--max_steps=1"],
                       check=False, cwd=repo, env=ENV, capture_output=True, text=True, timeout=120)
    assert (r.returncode == 2
            and r.stderr.count("\n") == 1
            and "holds files no run wrote" in r.stderr)
    assert snapshot(repo) == before


@needs_model
def test_overwrite_sets_the_old_run_aside_until_the_first_step(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    before = previous_run(out)

    def fail_in_step(*args, **kwargs):
        raise train.RunError("disk gone in the middle of step 1")

    real_update = train.grpo.update_policy

    def check_old_run_is_aside(*args, **kwargs):
        assert ((tmp_path / "run.overwritten" / "metrics.jsonl").read_text()
                == '{"step": 1}\n{"step": 2}\n')
        return fail_in_step()

    monkeypatch.setattr(train.grpo, "update_policy", check_old_run_is_aside)
    assert train.main(TINY + [f"--out_dir={out}", "--overwrite", "--max_steps=2"]) == 2
    assert "disk gone in the middle of step 1" in error_line(capsys)
    # the old run is back, as it was
    assert snapshot(out) == before | {".lock": snapshot(out)[".lock"]}
    monkeypatch.setattr(train.grpo, "update_policy", real_update)
    assert train.main(TINY + [f"--out_dir={out}", "--overwrite", "--max_steps=2"]) == 0
    assert not (tmp_path / "run.overwritten").exists()
    assert ((out / "checkpoints" / "step_000002" / "state_rank0.pt").read_bytes()
            != b"weights of a week-long run")
    assert [r["step"] for r in metrics(out)] == [1, 2]


@needs_model
def test_a_second_run_on_the_same_out_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    previous_run(out)
    with open(out / ".lock", "a+") as lock:  # as a run in another process holds it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(f"{os.getpid()}\n")  # (the holder's pid, as a run writes it)
        lock.flush()
        before = snapshot(out)
        assert train.main(TINY + [f"--out_dir={out}", "--overwrite", "--max_steps=1"]) == 2
        assert f"out_dir {out} is in use by another run (pid {os.getpid()})" in error_line(capsys)
        assert snapshot(out) == before


@needs_model
def test_long_prompts_are_dropped_and_counted(tmp_path, capsys):
    f = tmp_path / "mixed.jsonl"
    rows = ([{"problem": f"{i}+{i}", "answer": str(2 * i)} for i in range(1, 9)]
            + [{"problem": "9" * 10_000, "answer": "1"}])
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert train.main(TINY + [f"--out_dir={out}", f"--data.train={f}", "--max_steps=1",
                              "--data.max_prompt_tokens=100"]) == 0
    assert "note: dropped 1 training and 0 eval prompts over 100 tokens" in capsys.readouterr().err


@needs_model
def test_resume_refuses_changes_that_change_the_saved_state(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_train(out, steps=2).returncode == 0
    before = snapshot(out)
    for change, message in [(["--replay.strategy=aper"],
                             "--resume: replay.strategy differ from the checkpoint's"),
                            (["--rollout.group_size=2", "--rollout.batch_size=8"],
                             "rollout.batch_size, rollout.group_size"),
                            (["--max_steps=1"],
                             "--resume: max_steps (1) is below the checkpoint's step (2)")]:
        assert train.main(TINY + [f"--out_dir={out}", "--max_steps=3", "--resume", *change]) == 2
        assert message in error_line(capsys)
        assert snapshot(out) == before
    # harmless
    assert train.main(TINY + [f"--out_dir={out}", "--max_steps=3", "--resume", "--eval.k=2"]) == 0
    assert "changed: eval.k, max_steps" in capsys.readouterr().err


def test_non_empty_out_dir_needs_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    before = previous_run(out)
    assert train.main(["--config", str(REPO / "configs" / "tiny.yaml"), f"--out_dir={out}",
                       "--wandb.mode=disabled"]) == 2
    assert (f"out_dir {out} is not empty; pass --resume to continue it or --overwrite to start over"
            in error_line(capsys))
    assert snapshot(out) == before


def test_resume_without_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".run").write_text("{}\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert train.main(["--config", str(REPO / "configs" / "tiny.yaml"), f"--out_dir={out}",
                       "--resume"]) == 2
    assert f"--resume: no complete checkpoint in {out / 'checkpoints'}" in error_line(capsys)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


@needs_model
def test_unwritable_out_dir(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert train.main(TINY + [f"--out_dir={blocker / 'run'}", "--max_steps=1"]) == 2
    assert f"out_dir {blocker / 'run'} is not writable" in error_line(capsys)
    assert blocker.read_text() == "not a folder"
    assert train.main(TINY + [f"--out_dir={blocker}", "--max_steps=1"]) == 2
    assert f"out_dir {blocker} is a file" in error_line(capsys)


def test_debug_shows_the_traceback():
    with pytest.raises(Exception, match="unknown config key optim.lrr"):
        train.main(["--optim.lrr=1", "--debug"])


def test_exit_code_and_single_line_from_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml",
                        "--optim.lr=-1", f"--out_dir={tmp_path / 'x'}"],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr == "error: optim.lr must be in (0, 1], got -1.0\n"
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
    previous_run(out)
    torch.save({"step": 2, "evil": _Payload(marker)},
               out / "checkpoints" / "step_000002" / "state_rank0.pt")
    before = snapshot(out)
    argv = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={MODEL}",
            f"--out_dir={out}", "--resume", "--threads=1"]
    assert train.main(argv) == 2
    assert "step_000002: holds objects other than tensors and plain values" in error_line(capsys)
    assert not marker.exists()  # torch.load(weights_only=True) refused the payload
    assert snapshot(out) == before


@needs_model
def test_model_folder_code_does_not_run_by_default(tmp_path):
    # A model folder that ships its own modeling code: with trust_remote_code off (the default) it
    # must not be imported.
    folder, marker = tmp_path / "model", tmp_path / "pwned"
    folder.mkdir()
    for f in MODEL.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    argv = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={folder}",
            f"--out_dir={tmp_path / 'run'}", "--max_steps=0", "--eval.n=2", "--eval.k=1",
            "--threads=1", "--wandb.mode=disabled"]
    # the built-in Qwen2 class loads the weights, or the load is refused with one line: either is
    # safe
    train.main(argv)
    assert not marker.exists()


@needs_model
@pytest.mark.parametrize("args, message", [
    (["--k", "0"], "--k must be ≥ 1, got 0"), (["--k", "-3"], "--k must be ≥ 1, got -3"),
    (["--template", "Q: {question}"], "--template must be text containing {problem}"),
    (["--out-dir", "A_FILE"], "is a file"), (["--model", "BROKEN"], "cannot load model"),
])
def test_eval_bad_input_is_one_line(tmp_path, args, message):
    (tmp_path / "a_file").write_text("x")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    args = [str(tmp_path / "a_file") if a == "A_FILE" else str(broken) if a == "BROKEN" else a
            for a in args]
    cmd = [sys.executable, "eval.py", "--model", str(MODEL), "--benchmarks", "tiny", "--limit", "2",
           "--k", "1", "--max-new-tokens", "4", "--template", "{problem}", *args]
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr[-2000:]
    no_traceback(r)


@needs_model
def test_eval_writes_into_the_run_and_never_overwrites(tmp_path):
    run = tmp_path / "run"
    assert run_train(run, steps=1).returncode == 0
    cmd = [sys.executable, "eval.py", "--model", str(run / "final"), "--benchmarks", "tiny",
           "--limit", "2", "--k", "1", "--max-new-tokens", "4", "--template", "{problem}"]
    r = subprocess.run([sys.executable, str(REPO / "eval.py"), *cmd[2:]], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    result = run / "eval" / "final" / "results.json"
    first = result.read_bytes()
    r = subprocess.run([sys.executable, str(REPO / "eval.py"), *cmd[2:]], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=300, check=False)
    assert (r.returncode == 2
            and "exists; pass --overwrite" in r.stderr
            and result.read_bytes() == first)
    no_traceback(r)
