"""Whole or refused: a checkpoint's manifest (every file, its size and sha256, written last: a
checkpoint without one is not resumed), the trainer state's fields, a model folder's weights and
tokenizer. Each check runs before anything is used, so a partial or damaged folder is one line
naming what is wrong, never a traceback halfway through a resume, nor a model that runs with
freshly initialised tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from data.loaders import open_regular
from support.util import RunError, fsync, oneline

MANIFEST = "manifest.json"
PROBE = "What is 12 + 30? Put the answer in \\boxed{42}."  # text every math tokenizer encodes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
COUNTS = ("step", "data_pos", "generated_tokens", "source_tokens", "trained_tokens",
          "trained_rows")
LARGEST = 1 << 53  # a count beyond any run (and beyond a float's integers)


def refuse(fault: str | None) -> None:
    if fault:
        raise RunError(fault)


# ------------------------------------------------------------------------------ checkpoints


def digest(path: Path) -> str:
    """sha256 of a file, read in chunks (a model's GBs never sit in memory at once)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder: Path) -> None:
    """manifest.json: every file below `folder` with its size in bytes and its sha256 (a file
    changed at the same size is found too), fsync'ed. Written by rank 0 after every rank has
    written its files, before the folder is renamed into place."""
    files, sha256 = {}, {}
    for f in sorted(folder.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            files[str(f.relative_to(folder))] = f.stat().st_size
            sha256[str(f.relative_to(folder))] = digest(f)
    path = folder / MANIFEST
    path.write_text(json.dumps({"files": files, "sha256": sha256}, indent=1) + "\n")
    fsync(path)


def read_manifest(ck: Path) -> tuple[dict, dict] | None:
    """({file: size}, {file: sha256}) that checkpoint `ck`'s manifest.json lists (None: it has
    none); ValueError when it is not a manifest (text, JSON or fields of another kind)."""
    if not (ck / MANIFEST).exists():
        return None
    try:
        with open_regular(ck / MANIFEST, 1 << 24) as f:
            manifest = json.loads(f.read())
        sizes = {str(name): int(size) for name, size in manifest["files"].items()}
        hashes = {str(name): str(h) for name, h in manifest.get("sha256", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{MANIFEST} is damaged") from None
    return sizes, hashes


def manifest_fault(ck: Path) -> str | None:
    """Why checkpoint `ck` is not whole by its manifest.json (None: it is): the manifest missing,
    damaged or listing nothing; a file it lists missing, of another size or content (sha256), or
    without its sha256; a file in the folder it does not list (which a load would read unchecked).
    Every checkpoint this code resumes carries one: without it the content goes unchecked."""
    try:
        listed = read_manifest(ck)
    except ValueError as e:
        return str(e)
    if listed is None:
        return f"{MANIFEST} is missing"
    sizes, hashes = listed
    if not sizes:
        return f"{MANIFEST} lists no files"
    found = {str(f.relative_to(ck)) for f in ck.rglob("*") if f.is_file()} - {MANIFEST}
    missing = sorted((sizes.keys() | hashes.keys()) - found)  # (a name outside `ck` too)
    if missing:
        return f"{missing[0]} is missing"
    unlisted = sorted(found - sizes.keys())
    if unlisted:
        return f"{unlisted[0]} is in the folder but not in its {MANIFEST}"
    for name, size in sizes.items():
        if (ck / name).stat().st_size != size:
            return f"{name} is {(ck / name).stat().st_size:,} bytes, its {MANIFEST} says {size:,}"
    unhashed = sorted(sizes.keys() - hashes.keys())
    if unhashed:
        return f"{MANIFEST} gives no sha256 for {unhashed[0]}"
    for name, h in hashes.items():
        if digest(ck / name) != h:
            return f"{name}'s content is not what its {MANIFEST} says (sha256)"
    return None


def _count(v) -> bool:
    return type(v) is int and v >= 0  # (a bool is no count)


def _finite(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


RUN_FIELDS = (*COUNTS, "wall", "skipped", "config", "eval_initial", "eval_last", "pending_row")


def older_layout(ck: Path, state=None) -> str | None:
    """What marks checkpoint `ck` as written by older code, in a layout this code does not resume
    (None: this layout, whole or damaged). The layout that added run.trained_rows added the
    manifest, and the one that added run.data_sha256 had the manifest's sha256: a state holding
    those fields is this layout's whatever became of its manifest, so a checkpoint whose manifest
    was deleted or cut to sizes is damaged, never taken for an older one. `state`: its
    state_rank0.pt (None: judged by its files alone)."""
    if state is None:
        old = (ck / "trainer_state.pt").is_file() and not (ck / "state_rank0.pt").exists()
        return "trainer_state.pt, no state_rank0.pt" if old else None
    if not isinstance(state, dict):
        return None
    run = state.get("run") if isinstance(state.get("run"), dict) else {}
    try:
        listed = read_manifest(ck)
    except ValueError:
        return None  # a damaged manifest: damaged
    if listed is not None:  # (the older layout with a manifest listed sizes alone)
        sizes_only = not listed[1] and run and "data_sha256" not in run
        return f"its {MANIFEST} lists sizes alone, no sha256" if sizes_only else None
    if "optimizer" in state and not (ck / "optimizer.pt").is_file():
        return "the optimizer state inside state_rank0.pt, no optimizer.pt"
    missing = [k for k in ("world", "rng", "replay", "run") if k not in state]
    missing += [f"run.{k}" for k in RUN_FIELDS if run and k not in run]
    return f"its trainer state has no {', '.join(missing[:3])}" if missing else None


def state_fault(state, ck: Path) -> str | None:
    """Why a trainer state (state_rank{r}.pt of checkpoint `ck`) cannot be resumed: a field missing,
    of another type or out of its range (None: it can)."""
    run = state.get("run") if isinstance(state, dict) else None
    if not isinstance(run, dict):
        return "trainer state without its run progress"
    world = state.get("world")
    fields = [("world", world, type(world) is int and world >= 1, "an integer ≥ 1")]
    for key in ("rng", "replay"):
        fields.append((key, state.get(key), isinstance(state.get(key), dict), "a mapping"))
    for key in COUNTS:
        fields.append((f"run.{key}", run.get(key), _count(run.get(key)), "an integer ≥ 0"))
    skipped = run.get("skipped")
    counts = isinstance(skipped, dict) and all(map(_count, skipped.values()))
    fields += [("run.wall", run.get("wall"), _finite(run.get("wall")), "a finite number ≥ 0"),
               ("run.skipped", skipped, counts, "a mapping of integers ≥ 0")]
    for key in ("config", "eval_initial", "eval_last"):
        fields.append((f"run.{key}", run.get(key), isinstance(run.get(key), dict), "a mapping"))
    data = run.get("data_sha256")
    fields.append(("run.data_sha256", data, data is None or isinstance(data, str), "none or text"))
    row = run.get("pending_row")
    fields.append(("run.pending_row", row, row is None or isinstance(row, dict), "none or a row"))
    for key, value, ok, rule in fields:
        if not ok:
            return f"trainer state: {key} must be {rule}, got {repr(value)[:40]}"
    big = [(f"run.{k}", run[k]) for k in COUNTS if run[k] >= LARGEST] + [("world", world)] * (
        world > 1 << 16)
    if big:
        return f"trainer state: {big[0][0]} is {repr(big[0][1])[:40]}, beyond any run"
    lost = [i for i in range(world) if not (ck / f"state_rank{i}.pt").is_file()]
    if lost:
        return f"state_rank{lost[0]}.pt is missing, and its state says {world} processes saved it"
    if ck.name != f"step_{run['step']:06d}":
        return f"its trainer state is of step {run['step']}"
    return None


# ------------------------------------------------------------------------------ model folders


def weights_fault(info: dict) -> str | None:
    """What from_pretrained's loading info lists: tensors the folder lacks (which transformers would
    initialise at random), holds beyond the architecture, or holds in another shape. Tied weights
    (an lm_head sharing the embeddings) are not listed. None: the weights are whole."""
    said = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"),
                      ("mismatched_keys", "of another shape")):
        names = sorted(k[0] if isinstance(k, tuple) else str(k) for k in info.get(key) or ())
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            said.append(f"{len(names)} {what} ({', '.join(names[:3])}{more})")
    if said:
        return f"its weights do not fit its architecture: tensors {'; '.join(said)}"
    return None


def tokenizer_fault(tokenizer, model, path: str) -> str | None:
    """Why the tokenizer cannot serve `model` (None: it can): a probe text must encode to a
    non-empty list of ids within the model's embedding rows. Without its files transformers builds
    a tokenizer of special tokens alone, which encodes every prompt to nothing."""
    rows = model.get_input_embeddings().weight.shape[0]
    try:
        ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    except Exception as e:  # a broken tokenizer file fails in its own ways
        return f"its tokenizer fails on a probe text ({type(e).__name__}: {oneline(e, 100)})"
    if not ids:
        files = [name for name in TOKENIZER_FILES if (Path(path) / name).is_file()]
        missing = "" if files else f" (no {', '.join(TOKENIZER_FILES)} in the folder)"
        return f"its tokenizer encodes a probe text to no tokens{missing}"
    bad = [i for i in ids if type(i) is not int or not 0 <= i < rows]
    if bad:
        return f"its tokenizer gives id {bad[0]}, outside the model's {rows:,} embedding rows"
    return None
