"""Folder locks, never taken through a symbolic link: a run's out_dir (held by the run alone,
from the start of set-up to the end) and eval.py's results folder (its own, and inside a run the
run's lock shared: no run starts on a folder an eval writes into, and no eval writes into a run
under way).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import contextmanager
from pathlib import Path

from support.util import RunError


def open_lock(path: Path, shared: bool = False):
    """`path` opened as a lock (created unless `shared`: then None when there is none), never
    through a symbolic link: a link would have the pid written into whatever file it names."""
    flags = os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT | os.O_APPEND
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except FileNotFoundError:
        if shared:
            return None
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunError(f"{path} is a symbolic link, not a run's lock; remove it") from None
        if e.errno != errno.EISDIR:
            raise
        fd = None
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise RunError(f"{path} is not a regular file, not a run's lock; remove it")
    return os.fdopen(fd, "r" if shared else "a+")


def lock_folder(out: Path, what: str = "out_dir", who: str = "another run") -> tuple:
    """out_dir, created if need be, locked by this process (the lock dies with it): (the open
    .lock, its text before, None if this created it). A .lock removed by a run that failed while
    we opened it is opened again: a lock on a removed file would lock nothing."""
    path = out / ".lock"
    for _ in range(3):
        existed = path.is_file()
        try:
            out.mkdir(parents=True, exist_ok=True)
            lock = open_lock(path)
        except OSError as e:
            raise RunError(f"{what} {out} is not writable: {e.strerror or e}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunError(f"{what} {out} is in use by {holder(lock, who)}") from None
        if path.is_file() and os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
            break
        lock.close()
    lock.seek(0)
    before = lock.read() if existed else None
    lock.truncate(0)  # ("a+": the write goes to the end)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock, before


def holder(lock, who: str) -> str:
    """Who holds the lock `lock` was refused (closed here), as far as it is known: `who` with its
    pid when the pid written in .lock is the holder's; else the holder's pid from /proc/locks and
    the pid .lock names, which is not it (a lock taken by some other program, or a writer that
    died, its pid left in the file); eval.py shares a run's while it writes results into it."""
    holders = lock_holders(lock)  # (before this process takes a shared lock of its own)
    try:
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        lock.close()
        return "an eval.py writing its results into it"
    except BlockingIOError:
        lock.seek(0)
        named = lock.read(64).strip()
    lock.close()
    if named in holders:
        return f"{who} (pid {named})"
    if not holders:  # (no /proc/locks: what .lock says is all that is known)
        return f"{who} (its .lock names pid {named or '?'})"
    return (f"another process (pid {', '.join(sorted(holders))}; its .lock names pid "
            f"{named or '(none)'}, which does not hold it)")


def lock_holders(lock) -> set[str]:
    """The pids holding a flock on the file `lock` is open on, by /proc/locks (Linux; empty
    elsewhere, or for a holder in another pid namespace)."""
    st = os.fstat(lock.fileno())
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return set()
    pids = set()
    for row in rows:  # "1: FLOCK ADVISORY WRITE <pid> <maj:min:inode> 0 EOF"; "1: -> ...": waiting
        if len(row) > 5 and row[1] == "FLOCK" and row[5] == where and row[4] != "0":
            pids.add(row[4])
    return pids


def is_run(folder: Path) -> bool:
    """Whether `folder` is a training run's (its marker, or what a run writes at its root)."""
    return (folder / ".run").is_file() or any(
        (folder / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints"))


def results_dir(out: Path) -> tuple[Path, Path | None]:
    """(`out` resolved, the run folder it is inside or None). A run's root holds only what the run
    wrote (--resume refuses a folder that holds anything else): results go into its eval/ or
    outside it."""
    real = Path(os.path.realpath(out))
    run = next((p for p in (real, *real.parents) if is_run(p)), None)
    if run is not None and not real.is_relative_to(run / "eval"):
        where = "is the training run folder" if real == run else "is inside the training run"
        raise RunError(f"--out-dir {out} {where} {run}; write into {run / 'eval'} or outside it")
    return real, run


@contextmanager
def results_folder(out: Path):
    """eval.py's results folder, locked while the eval runs (of two evals into one folder, the
    second is refused); inside a run, the run's lock is shared too: a run under way on it refuses
    the eval, and a run started on it meanwhile is refused (its model would not be the one
    evaluated). What the lock made goes when it ends: the folders (if still empty), .lock."""
    real, run = results_dir(out)
    made = [p for p in (real, *real.parents) if not p.exists()]
    shared = share_lock(run) if run is not None else None
    try:
        lock, before = lock_folder(real, "--out-dir", "another eval.py")
        try:
            yield real
        finally:
            restore_lock(real, lock, before)
            lock.close()
    finally:
        remove_empty(made)
        if shared is not None:
            shared.close()


def share_lock(run: Path):
    """The run's .lock, held shared (None when it has none); refused while a run holds it."""
    lock = open_lock(run / ".lock", shared=True)
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunError(f"{run} is in use by {holder(lock, 'a run')}: evaluate into it once that "
                       "run has ended, or pass --out-dir outside it") from None
    return lock


def restore_lock(out: Path, lock, before: str | None) -> None:
    """.lock as lock_folder found it: its text back, or gone if lock_folder made it."""
    if before is None:
        (out / ".lock").unlink(missing_ok=True)
        return
    lock.truncate(0)
    lock.write(before)
    lock.flush()


def remove_empty(folders: list[Path]) -> None:
    """The folders a lock made, deepest first, while empty (one that is not is not only ours)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break
