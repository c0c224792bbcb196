"""Small helpers: the bad-input error, an exception as one line, what a path or a text must be,
dependencies kept quiet, a timer, a dtype by name, the global RNG streams as plain values; a
process and everything it started, stopped, and a command run under a time cap (for the tests and
bench scripts)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch


class RunError(Exception):
    """Bad input, or a failed read or write, found while running: one line, exit 2."""

    def __str__(self) -> str:
        return printable(Exception.__str__(self))


def printable(text: str) -> str:
    """`text` with each character that is not printable written as repr writes it (a newline as
    \\n): a path may hold one, and a refusal naming it stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def oneline(e: Exception, n: int = 300) -> str:
    """An exception's message on one line, at most `n` characters."""
    return " ".join(str(e).split())[:n]


NAME_MAX = 255  # bytes of one path component (Linux, and most file systems)
PATH_MAX = 4000  # bytes of a path: the kernel's 4096, less room for the names a run writes inside


def path_fault(path: str, suffix: str = "") -> str | None:
    """Why `path` cannot be a file system path (None when it can): a NUL byte, a component over
    NAME_MAX bytes (the last one with `suffix` added, as `.overwritten` or `.meta.json` will be), or
    over PATH_MAX bytes in all once absolute. Checked before anything is created, so a refused path
    is one line, not an OSError halfway through a run."""
    if "\0" in path:
        return "holds a NUL byte"
    try:
        parts = [os.fsencode(part) for part in os.path.abspath(path).split(os.sep)]
    except UnicodeError:
        return "is not valid Unicode text"
    longest = max(parts, key=len)
    if len(longest) > NAME_MAX:
        name = longest.decode(errors="replace")[:20]
        return f"has a component of {len(longest)} bytes ({name}...), over {NAME_MAX}"
    if len(parts[-1] + suffix.encode()) > NAME_MAX:
        return f"ends in {len(parts[-1])} bytes: with {suffix} added, over {NAME_MAX}"
    total = sum(map(len, parts)) + len(parts) - 1 + len(suffix.encode())
    if total > PATH_MAX:
        return f"is {total:,} bytes long, over {PATH_MAX:,}"
    return None


def folder_fault(path: str) -> str | None:
    """Why `path` cannot be an output folder (None: it can; made if missing): empty (it would be
    the current folder), no file system's path, a file, under a file, or not writable."""
    if not path.strip():
        return "is empty"
    fault = path_fault(path)
    if fault:
        return fault
    folder = Path(path).absolute()
    if folder.exists() and not folder.is_dir():
        return "is a file, not a folder"
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        return f"is under {existing}, a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be written: {existing} is not writable"
    return None


def file_fault(path: str, overwrite: bool, makes_folder: bool = False) -> str | None:
    """Why a script must not write the file `path` (None: it may): empty, no file system's path, a
    folder or not a regular file, an existing file unless `overwrite` (a script never replaces
    what it does not own), its folder missing unless the script makes it (`makes_folder`), or a
    folder it cannot write."""
    if not path.strip():
        return "is empty"
    fault = path_fault(path)
    if fault:
        return fault
    file = Path(path)
    if file.is_dir():
        return "is a folder, not a file"
    if file.exists() and not file.is_file():
        return "exists and is not a regular file"
    if file.exists() and not overwrite:
        return "exists; pass --overwrite to replace it"
    if not makes_folder and not file.parent.exists():
        return f"is in a folder that does not exist ({file.parent})"
    fault = folder_fault(str(file.parent))
    if fault:
        return f"is in {file.parent}, which {fault}"
    return None


def text_fault(text: str) -> str | None:
    """Why `text` is not valid Unicode (None when it is): a lone UTF-16 surrogate, which JSON and
    YAML escapes (\\ud800) produce and every tokenizer and file write then fails on."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start})"
    return None


@contextmanager
def utf8_path(folder):
    """`folder` named as the tokenizers library (Rust, which takes UTF-8 text) can open it: its
    own name, or, where that holds bytes the locale could not decode (LC_ALL=C: Python reads each
    as a lone surrogate), the folder opened and named through /proc/self/fd (Linux) while inside."""
    name = str(folder)
    if not text_fault(name) or not os.path.isdir(name) or not os.path.isdir("/proc/self/fd"):
        yield name
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


@contextmanager
def quiet(debug: bool):
    """Dependencies' warnings (FutureWarning, DeprecationWarning) and transformers' reports (the
    load report, deprecations) are for --debug: on bad input stderr holds our one line only."""
    if debug:
        yield
        return
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        logging.set_verbosity(level)


@contextmanager
def command_errors(prefix: str, debug: bool, errors: tuple):
    """Every command's bad input (`errors`): one line `<prefix>error: ...` on stderr and exit
    code 2 (SystemExit), nothing else printed; with --debug (`debug`) its traceback. Any other
    exception is a bug: a traceback. Dependencies' warnings are for --debug too (`quiet`)."""
    try:
        with quiet(debug):
            yield
    except errors as e:
        if debug:
            e.__suppress_context__ = False  # the exception it replaced is shown too
            raise
        stderr_line(f"{prefix}error: {oneline(e, 10**6)}")
        raise SystemExit(2) from None


def stderr_line(line: str) -> None:
    """`line` on stderr in one write: the ranks of a torchrun share the pipe, and print's two
    writes (the text, then the newline: stderr writes through) let another rank's line in."""
    sys.stderr.write(line + "\n")


@contextmanager
def reworded(what: str, *errors: type):
    """`errors` raised in the block become a RunError (one line, after `what`): bad input a callee
    reports with a library's exception."""
    try:
        yield
    except errors as e:
        raise RunError(f"{what}{oneline(e)}") from None


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2, as every other bad input (no usage block)."""

    def error(self, message: str):
        stderr_line(f"{self.prog}: error: {' '.join(message.split())}")
        raise SystemExit(2)


def library_versions() -> str:
    """The versions that decide a run's numbers, as runs record them (summary.json)."""
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def seed_all(seed: int, rank: int, threads: int) -> None:
    """Seed python, numpy and torch (each rank's torch differently: ranks sample differently);
    `threads` > 0 sets torch's intra-op threads."""
    if threads:
        torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed + rank)


def other_versions(versions: list[str], here: str) -> list[str]:
    """A note for a resume on library versions (`here`) other than the run's (`versions`)."""
    if not versions:
        return []
    return [f"note: resumed on {here}, not on what the run ran on "
            f"({'; '.join(versions)}): eval.py --compare refuses to pool it unless --allow-mixed"]


def fsync(path: Path) -> None:
    """Flush a file (or a folder: a rename in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_dtype(name: str) -> torch.dtype:
    """model.compute_dtype as a torch dtype (float32 or bfloat16)."""
    return getattr(torch, name)


def flatten(d: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested dict."""
    flat = {}
    for name, value in d.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{name}.")
        else:
            flat[f"{prefix}{name}"] = value  # (a YAML key may be a number)
    return flat


def flat_dict(cfg) -> dict:
    """{dotted key: value} of every leaf of a config (dataclasses)."""
    return flatten(dataclasses.asdict(cfg))


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, children before grandchildren, from /proc (none elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while we looked
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])  # the fields after the command's ")"
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found = list(children.get(pid, []))
    for child in found:
        found += children.get(child, [])
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, its process group and every process below it. torchrun starts each worker in
    a session of its own, so a signal to the launcher's group alone leaves the workers running,
    writing to the run's folder and holding the launcher's output pipes open (a caller reading
    them to their end would wait forever)."""
    below = descendants(pid)  # before the kill: then they are re-parented and lost
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not a group leader, or gone
        pass
    for p in [pid, *below]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_capped(cmd: list[str], timeout: float, **popen) -> tuple[int | None, str, str | None]:
    """Run `cmd` in a session of its own to its end or for `timeout` seconds: (exit code, stdout,
    stderr) as text; the code is None when the cap stopped it (kill_tree: nothing it started lives
    on). `popen` goes to Popen (cwd, env; stderr=subprocess.STDOUT merges the two)."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} | popen
    p = subprocess.Popen(cmd, text=True, start_new_session=True, **popen)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, err = p.communicate()
        return None, out, err
    return p.returncode, out, err
