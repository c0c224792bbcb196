"""The run's folder, as rank 0 holds it: one run at a time (locked before anything in it is read,
to the end), --overwrite's old run kept aside until the new one has a step, atomic writes, and what
a resume rewrites (config.yaml, metrics.jsonl cut back) written aside and renamed into place once
the resumed run has saved its first checkpoint (or ended): a run that fails before then leaves
every file as it found it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from metrics import RunLog
from support.locks import lock_folder, remove_empty, restore_lock
from support.util import RunError, flat_dict, fsync

# What runs write in out_dir (and `.tmp_` + each while it is written): a folder holding anything
# else is never overwritten.
RUN_FILES = {".run", ".lock", "config.yaml", "metrics.jsonl", "summary.json", "checkpoints",
             "final", "wandb", "eval"}
ASIDE = ".overwritten"  # where --overwrite keeps the old run: <out_dir>.overwritten
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")  # what wandb accepts


@dataclass
class WandbConfig:
    mode: str = "offline"
    """disabled | offline | online."""
    project: str = "replay-grpo"
    """wandb project."""
    group: str = ""
    """Runs of one comparison share a group (default: none)."""
    name: str = ""
    """Run name (default: strategy-seed)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        modes = ("disabled", "offline", "online")
        return {"mode": (self.mode in modes, "disabled, offline or online")}

    def check_environment(self) -> None:
        """wandb reads WANDB_MODE over wandb.mode and fails on a value it does not know only in
        wandb.init, after the run has claimed its folder: refused before anything is written."""
        env = os.environ.get("WANDB_MODE")
        if self.mode != "disabled" and env is not None and env not in WANDB_MODES:
            raise RunError(f"WANDB_MODE={env!r} in the environment is not a wandb mode "
                           f"({', '.join(WANDB_MODES)}); unset it or fix it")


def aside(out: Path) -> Path:
    return out.with_name(out.name + ASIDE)


class RunFolder:
    """out_dir of one run. Rank 0 locks it at the start of set-up and holds it to the end; the
    other ranks only check it (every method is a no-op there)."""

    def __init__(self, out_dir: str, rank: int):
        # resolved: --overwrite renames the folder, which must be the run's, not a link to it
        self.out = Path(os.path.realpath(out_dir))
        self.rank = rank
        self.lock = None  # the open .lock of the folder as found (held while it is aside too)
        self.before = None  # .lock's text before this run took it (None: taking it created it)
        self.made = []  # the folders taking the lock created, deepest first
        self.fresh = None  # --overwrite: the lock of the new folder while the old one is aside
        self.pending = []  # a resume's config.yaml and metrics.jsonl, written aside

    @contextmanager
    def setting_up(self, resume: str | None, overwrite: bool):
        """Lock out_dir (rank 0) before anything in it is read, check it, run the block (set-up):
        two runs started together on one folder, one of them is refused. A failure leaves the
        folder as it was: what the lock created goes, .lock's text comes back."""
        if self.out.exists() and not self.out.is_dir():
            raise RunError(f"out_dir {self.out} is a file")
        try:
            if self.rank == 0:
                self.made = [p for p in (self.out, *self.out.parents) if not p.exists()]
                self.lock, self.before = lock_folder(self.out)
            check_out_dir(self.out, resume, overwrite)
            yield self
        except BaseException:
            self.restore()
            self.close()
            raise

    def claim(self, overwrite: bool) -> None:
        """After set-up: --overwrite renames the old run aside (whole, still locked) and starts a
        new folder; the .run marker says a run wrote this folder."""
        if self.rank:
            return
        try:
            if overwrite and (self.out / ".run").exists():
                os.replace(self.out, aside(self.out))
                self.fresh = lock_folder(self.out)[0]
            if not (self.out / ".run").exists():
                (self.out / ".run").write_text(json.dumps({"created": time.time()}) + "\n")
        except OSError as e:
            raise RunError(f"out_dir {self.out} is not writable: {e.strerror or e}") from None

    def open_log(self, cfg, step: int, wandb_id: str | None, resumed: bool) -> RunLog:
        """config.yaml, metrics.jsonl (on resume: both written aside, the metrics cut back to the
        checkpoint's `step`), the wandb run (a resume continues `wandb_id`): rank 0's log (another
        rank's writes nothing)."""
        if self.rank:
            return RunLog(None, None, wandb_id)
        config = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
        path = self.out / "metrics.jsonl"
        if resumed:  # lines after the checkpoint will be written again; a line cut by a kill goes
            kept = cut_back(path, step)
            self.pending = [self.out / ".tmp_metrics.jsonl", self.out / ".tmp_config.yaml"]
            for tmp, text in zip(self.pending, (kept, config)):
                write_synced(tmp, text)
            path = self.pending[0]
        else:
            write_file(self.out / "config.yaml", config)
        return RunLog(open(path, "a"), start_wandb(cfg, self.out, wandb_id), wandb_id)

    def step_done(self, saved: bool) -> None:
        """After a step: the run --overwrite set aside goes; once a checkpoint is `saved`, a
        resume's files go into place (its log file stays open: a rename keeps the file)."""
        if self.rank:
            return
        if self.fresh is not None:
            shutil.rmtree(aside(self.out))
            self.lock.close()
            self.lock, self.before, self.fresh = self.fresh, None, None
        if saved:
            self.commit()

    def commit(self) -> None:
        """A resume's files go into place; summary.json goes with them: it is of an end the run
        has gone past (a finished run resumed with a larger max_steps), and train.finish writes
        the new end's. Until then a copy or a reproduction does not take the folder for finished."""
        for tmp in self.pending:
            os.replace(tmp, tmp.with_name(tmp.name.removeprefix(".tmp_")))
        if self.pending:
            (self.out / "summary.json").unlink(missing_ok=True)
            fsync(self.out)
        self.pending = []

    def failed(self) -> None:
        """The run failed: what it has not made its own yet goes back (a resume's files, the run
        --overwrite set aside), and .lock's text."""
        if self.rank:
            return
        for tmp in self.pending:
            tmp.unlink(missing_ok=True)
        self.pending = []
        if self.fresh is not None:  # the new run failed before its first step: the old returns
            shutil.rmtree(self.out)
            self.fresh.close()
            self.fresh = None
            os.replace(aside(self.out), self.out)
        self.restore(claimed=True)

    def restore(self, claimed: bool = False) -> None:
        """.lock as this run found it (its text back, or gone unless the run had `claimed` the
        folder: then it stays, a run's file), and the folders the lock made."""
        if self.lock is None or self.lock.closed:
            return
        if self.before is not None or not claimed:
            restore_lock(self.out, self.lock, self.before)
        remove_empty(self.made)

    def close(self) -> None:
        for lock in (self.lock, self.fresh):
            if lock is not None:
                lock.close()


def check_out_dir(out: Path, resume: str | None, overwrite: bool) -> None:
    """Refuse, before anything is created or deleted, an out_dir this run may not use."""
    names = set()
    if out.is_dir():
        names = {p.name for p in out.iterdir()} - {".lock"}
    strange = sorted(n for n in names if n.removeprefix(".tmp_") not in RUN_FILES)
    if names and (strange or not (out / ".run").is_file()):
        listed = ", ".join(strange[:3]) or "no .run marker"
        raise RunError(f"out_dir {out} holds files no run wrote ({listed}); choose another out_dir")
    if names and resume is None and not overwrite:
        raise RunError(f"out_dir {out} is not empty; "
                       "pass --resume to continue it or --overwrite to start over")
    if overwrite and aside(out).exists():
        raise RunError(f"{aside(out)} holds a run an interrupted --overwrite set aside; "
                       "move it back or delete it")


def write_synced(path: Path, text: str) -> None:
    """`text` into `path`, fsync'ed; a failed write leaves no partial file."""
    try:
        path.write_text(text)
        fsync(path)
    except OSError:
        path.unlink(missing_ok=True)  # left behind, it would make out_dir look like no run's
        raise


def write_file(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically: a temporary file, fsync'ed, renamed."""
    tmp = path.with_name(f".tmp_{path.name}")
    write_synced(tmp, text)
    os.replace(tmp, path)
    fsync(path.parent)


def cut_back(path: Path, step: int) -> str:
    """The lines of metrics.jsonl up to `step` (a line cut by a kill is left out)."""
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass
    return "".join(kept)


def start_wandb(cfg, out: Path, run_id: str | None):
    """The wandb run (None when off); a resumed run continues its own (`run_id`)."""
    if cfg.wandb.mode == "disabled":
        return None
    import wandb

    w = cfg.wandb
    strategy = cfg.replay.strategy
    run = wandb.init(project=w.project, group=w.group or None,
                     name=w.name or f"{strategy}-s{cfg.seed}", tags=[strategy],
                     config=flat_dict(cfg), dir=str(out), mode=w.mode, id=run_id,
                     resume="allow" if run_id else None)
    return run
