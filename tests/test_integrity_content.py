"""Integrity by content, not only by size (#49), refused by train.py and eval.py in subprocesses (a
run that succeeds: train.py's main in this process): a checkpoint file changed at its size is
refused at --resume (its manifest's sha256); a training or eval file giving one problem two gold
answers, or an answer blank to the eye, is refused at load. Integrity does not lapse with the
manifest (#58): a checkpoint of this layout whose manifest is gone, empty or incomplete is refused
as damaged, never resumed as an older layout's; a method's state missing from a checkpoint of a run
that had it is refused.

  pytest -q tests/test_integrity_content.py        # ~1 min on 2 busy cores
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import snapshot, train_here
from safetensors.torch import load_file, save_file

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
from support import integrity

MODEL = REPO / "data" / "tiny_model"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
       "TOKENIZERS_PARALLELISM": "false"}
TINY = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={MODEL}",
        "--rollout.batch_size=16", "--rollout.group_size=4", "--rollout.max_new_tokens=24",
        "--eval.n=8", "--eval.k=1", "--eval.every=0", "--checkpoint.every=2",
        "--checkpoint.keep_last=3", "--threads=1", "--wandb.mode=disabled"]
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="no tiny model")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300, check=False)


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    return r.stderr


@pytest.mark.parametrize("name", ["model.safetensors", "state_rank0.pt"])
def test_a_checkpoint_file_changed_at_its_size_is_refused(tmp_path, name):
    out = tmp_path / "run"
    r = train_here(*TINY, f"--out_dir={out}", "--max_steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    f = out / "checkpoints" / "step_000004" / name
    data = bytearray(f.read_bytes())
    data[-4:] = bytes(b ^ 0x55 for b in data[-4:])  # a weight (or a pickled value) changed
    f.write_bytes(bytes(data))
    before = snapshot(out)
    line = refused(run("train.py", *TINY, f"--out_dir={out}", "--max_steps=6", "--resume"),
                   "checkpoint step_000004 is damaged", f"{name}'s content is not what",
                   "--resume=step_000002")
    assert "sha256" in line and snapshot(out) == before


def problems_file(tmp_path: Path, rows: list[dict]) -> Path:
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


GOOD = [{"problem": f"{i}+{i}", "answer": str(2 * i)} for i in range(1, 9)]
BAD = [  # (rows, what the line says)
    (GOOD + [{"problem": "3+3", "answer": "7"}], "rows 2 and 8 give one problem two gold answers"),
    (GOOD + [{"problem": " 4+4 ", "answer": "9"}], "two gold answers"),
    (GOOD + [{"problem": "9+9", "answer": "\u200b"}], "row 8: the gold answer (answer) must be"),
    (GOOD + [{"problem": "9+9", "answer": "\ufeff \u2060"}], "row 8: the gold answer"),
    (GOOD + [{"problem": "\u200b\u200b", "answer": "1"}], "row 8: the problem (problem)"),
]


@pytest.mark.parametrize("rows, words", BAD, ids=["two_golds", "two_golds_spaced",
                                                  "zero_width_answer", "bom_answer",
                                                  "zero_width_problem"])
def test_a_problem_with_two_golds_or_a_blank_one_is_refused_at_load(tmp_path, rows, words):
    f, out = problems_file(tmp_path, rows), tmp_path / "run"
    refused(run("train.py", *TINY, f"--out_dir={out}", f"--data.train={f}", "--max_steps=1"),
            f"error: data: {f}", words)
    assert not out.exists()
    res = tmp_path / "res"
    refused(run("eval.py", "--model", str(MODEL), "--benchmarks", str(f), "--k", "1",
                "--max-new-tokens", "4", "--out-dir", str(res)), words)
    assert not res.exists()


def test_a_problem_given_twice_with_one_gold_trains(tmp_path):
    f = problems_file(tmp_path, GOOD + [{"problem": "3+3", "answer": "6"}])
    r = train_here(*TINY, f"--out_dir={tmp_path / 'run'}", f"--data.train={f}", "--max_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_training_file_rewritten_in_place_is_refused_at_resume(tmp_path):
    """The checkpoint records the training problems' sha256: the same path with as many rows but
    other problems is refused at --resume (one line naming the file and what to do); the file put
    back resumes."""
    f, out = problems_file(tmp_path, GOOD), tmp_path / "run"
    r = train_here(*TINY, f"--out_dir={out}", f"--data.train={f}", "--max_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    original = f.read_bytes()
    problems_file(tmp_path, [{"problem": f"{i}*{i}", "answer": str(i * i)} for i in range(1, 9)])
    before = snapshot(out)
    refused(run("train.py", *TINY, f"--out_dir={out}", f"--data.train={f}", "--max_steps=4",
                "--resume"), f"the training data ({f})", "step_000002", "sha256",
            "restore the file, or start a new run")
    assert snapshot(out) == before
    f.write_bytes(original)
    r = run("train.py", *TINY, f"--out_dir={out}", f"--data.train={f}", "--max_steps=4",
            "--resume")
    assert r.returncode == 0, r.stderr[-3000:]


# ------------------------------------------------------- integrity without a manifest (#58)


SKIP = [*TINY, "--skip.enabled=true", "--checkpoint.every=1"]  # GRESO: a method with a state


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory) -> Path:
    """A GRESO run of 2 steps, a checkpoint after each."""
    out = tmp_path_factory.mktemp("skip") / "run"
    r = train_here(*SKIP, f"--out_dir={out}", "--max_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def copy_run(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(src, out)
    return out


def manifest(ck: Path, change) -> None:
    """manifest.json of `ck`, changed by `change` (the parsed JSON) and written back."""
    data = json.loads((ck / "manifest.json").read_text())
    change(data)
    (ck / "manifest.json").write_text(json.dumps(data))


def flip_a_weight(ck: Path) -> None:
    """Without its manifest, one byte of a weight flipped."""
    (ck / "manifest.json").unlink()
    data = bytearray((ck / "model.safetensors").read_bytes())
    data[-3] ^= 0x40
    (ck / "model.safetensors").write_bytes(bytes(data))


def swap_two_tensors(ck: Path) -> None:
    """Without its manifest, two weights of one shape swapped: every size stays, every header
    reads."""
    (ck / "manifest.json").unlink()
    weights = load_file(ck / "model.safetensors")
    by_shape = {}
    for name in sorted(weights):  # two layers' weights of one shape
        by_shape.setdefault(tuple(weights[name].shape), []).append(name)
    a, b = next(names for names in by_shape.values() if len(names) > 1)[:2]
    assert not torch.equal(weights[a], weights[b])
    weights[a], weights[b] = weights[b], weights[a]
    save_file(weights, ck / "model.safetensors", metadata={"format": "pt"})


def an_unlisted_shard(ck: Path) -> None:
    shutil.copy(ck / "model.safetensors", ck / "model-00002-of-00002.safetensors")


def drop_the_skip_state(ck: Path) -> None:
    """The skip state out of the trainer state, the manifest rewritten to match: whole, but
    without what GRESO had learnt."""
    state = torch.load(ck / "state_rank0.pt", weights_only=True)
    del state["skip"]
    torch.save(state, ck / "state_rank0.pt")
    integrity.write_manifest(ck)


WITHOUT = [  # (what is done to checkpoints/step_000002, what the line says)
    (flip_a_weight, "(manifest.json is missing)"),
    (swap_two_tensors, "(manifest.json is missing)"),
    (lambda ck: manifest(ck, lambda m: m.update(files={}, sha256={})),
     "(manifest.json lists no files)"),
    (lambda ck: manifest(ck, lambda m: m["files"].pop("model.safetensors")),
     "(model.safetensors is in the folder but not in its manifest.json)"),
    (lambda ck: manifest(ck, lambda m: m["sha256"].update({"adapter_model.safetensors": "0"})),
     "(adapter_model.safetensors is missing)"),
    (lambda ck: manifest(ck, lambda m: m.pop("sha256")),
     "(manifest.json gives no sha256 for "),
    (an_unlisted_shard, "(model-00002-of-00002.safetensors is in the folder but not in its "),
    (drop_the_skip_state, "its trainer state holds no skip state"),
]


@pytest.mark.parametrize("damage, words", WITHOUT, ids=["flip", "swap", "empty", "unlisted",
                                                        "listed_absent", "no_sha256", "extra_file",
                                                        "skip_state"])
def test_a_checkpoint_its_manifest_does_not_vouch_for_is_refused(skip_run, tmp_path, damage,
                                                                  words):
    """Integrity does not lapse with the manifest: deleted, emptied, cut to sizes, or not listing
    what the folder holds, the checkpoint is damaged (naming the intact one before it), never
    resumed unchecked as an older layout's; a GRESO checkpoint without its skip state is refused,
    not resumed with GRESO's state restarted."""
    out = copy_run(skip_run, tmp_path)
    damage(out / "checkpoints" / "step_000002")
    before = snapshot(out)
    line = refused(run("train.py", *SKIP, f"--out_dir={out}", "--max_steps=3", "--resume"),
                   "error: checkpoint step_000002 is damaged ", words)
    assert "older layout" not in line and snapshot(out) == before
    if damage is not drop_the_skip_state:  # (found once the state is read, after the manifest)
        assert "the newest intact one is step_000001: --resume=step_000001" in line


def test_an_older_layout_with_a_manifest_of_sizes_is_called_that(skip_run, tmp_path):
    """The layout before run.data_sha256 wrote manifests of sizes alone: one line saying so, with
    what to do (the same cut on this layout's checkpoint is damaged, above)."""
    out = copy_run(skip_run, tmp_path)
    ck = out / "checkpoints" / "step_000002"
    state = torch.load(ck / "state_rank0.pt", weights_only=True)
    del state["run"]["data_sha256"]
    torch.save(state, ck / "state_rank0.pt")
    integrity.write_manifest(ck)
    manifest(ck, lambda m: m.pop("sha256"))
    before = snapshot(out)
    line = refused(run("train.py", *SKIP, f"--out_dir={out}", "--max_steps=3", "--resume"),
                   "checkpoint step_000002 is of an older layout (its manifest.json lists sizes "
                   "alone, no sha256)", f"--model.path={ck}")
    assert "damaged" not in line and snapshot(out) == before


def test_a_checkpoint_whole_by_its_manifest_resumes(skip_run, tmp_path):
    """The rules above refuse nothing whole: the GRESO run resumes from step 2."""
    out = copy_run(skip_run, tmp_path)
    r = train_here(*SKIP, f"--out_dir={out}", "--max_steps=3", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr and (out / "checkpoints" / "step_000003").is_dir()
