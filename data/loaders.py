"""Math problems from their public schemas, as `Problem(problem, answer, id)` rows.

    load_problems("math500", data_dir="bench")  # bench/math500_test.jsonl (or gsm8k, aime24...)
    load_problems("dapo17k", data_dir="train")  # train/dapo17k_train.{jsonl,parquet} (math_train)
    load_problems("my.jsonl", problem_key="q", answer_key="a")  # any JSONL or parquet, fields named
    load_problems("hf:openai/gsm8k:main:test")  # hf:NAME[:CONFIG][:SPLIT] via `datasets` (optional)
    load_problems("tiny")                       # the embedded task's held-out split (tiny_task.py)
    load_problems("tiny_train")                 # ... and its training split (RLEP phase I)

Schemas recognised without a field mapping: `problem`/`question`/`prompt` (a string, or a list of
chat messages whose last user turn is the problem, as in DAPO-Math-17k); the answer is
`reward_model.ground_truth`, else `answer` (GSM8K: the text after `####`; numbers: 27.0 -> "27"),
else `solution` (its last \\boxed{...}, or the whole string when it has none). Answers are not
normalised here: equivalence is the verifier's job.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import numbers
import os
import re
import unicodedata
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple

import yaml

if TYPE_CHECKING:
    from data.tiny_task import TinyTask

MAX_LINE = 64 << 20  # bytes of one JSONL row; real ones (long proofs, chat transcripts) are < 1 MB
PARSED_BYTES = 8  # peak memory per byte of a data file, as dicts then Problems (measured: 8.3)


@dataclass
class Problem:
    problem: str  # the question text, without any prompt template
    answer: str  # gold answer as written in the source ("025", "70,000", "\\frac{14}{3}")
    id: str  # stable id from the source when it has one, else "{source}-{row}"
    source: str = ""  # benchmark name or file stem
    system: str = ""  # a chat-format row's system turn (ExGRPO's have one); data.system_prompt wins


NAMED = {  # name -> file stem in data_dir; benchmarks ship as JSONL, training sets may be parquet
    "math500": "math500_test",
    "gsm8k": "gsm8k_test",
    "aime24": "aime24_test",
    "aime25": "aime25_test",
    "amc23": "amc23_test",
    "math_train": "math_train",
    "dapo17k": "dapo17k_train",
    "gsm8k_train": "gsm8k_train",
}
# DAPO-Math-17k wraps each problem in an "Answer: $Answer" instruction; stripped, so every source
# gives bare problems.
_DAPO_HEAD = re.compile(r"^Solve the following math problem step by step\..*?\n\n", re.DOTALL)
_DAPO_TAIL = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.\s*$")


def load_problems(spec: str, *, data_dir: str | None = None, problem_key: str | None = None,
                  answer_key: str | None = None, limit: int | None = None,
                  tiny: TinyTask | None = None) -> list[Problem]:
    """Problems for a benchmark name, a .jsonl/.parquet path, `hf:NAME[:CONFIG][:SPLIT]`, or "tiny".

    "tiny" is the embedded task's fixed held-out split, "tiny_train" its training split of
    `tiny.train_size` problems; `tiny` holds the task's knobs (defaults when None), so train.py and
    eval.py build the same task.
    """
    if spec in ("tiny", "tiny_train"):
        from data.tiny_task import TEST_SIZE, TinyTask  # lazy: tiny_task imports this module

        tiny = tiny or TinyTask()
        if spec == "tiny":
            problems = tiny.load("test", limit or TEST_SIZE)
        else:
            problems = tiny.load("train", limit or tiny.train_size)
    else:
        source, rows, where = _read_rows(spec, data_dir, limit)
        problems = [_to_problem(row, i, source, where, problem_key, answer_key)
                    for i, row in enumerate(rows)]
        _refuse_two_golds(problems, where)
    if not problems:
        raise ValueError(f"{spec}: no problems found (empty dataset)")
    return problems


def load_task(data, eval_n: int) -> tuple[list[Problem], list[Problem]]:
    """(training problems, held-out eval problems) for config.DataConfig `data`; eval takes the
    first `eval_n` (0 = all) of each comma-separated eval spec."""
    folder = data.data_dir or None
    spec = "tiny_train" if data.train == "tiny" else data.train
    train = load_problems(spec, data_dir=folder, problem_key=data.problem_key or None,
                          answer_key=data.answer_key or None, tiny=data.tiny)
    evals = []
    for spec in data.eval.split(","):
        evals += load_problems(spec, data_dir=folder, limit=eval_n or None, tiny=data.tiny)
    return train, evals


def problems_digest(problems: list[Problem]) -> str:
    """sha256 of the training problems in their order (question, gold answer, system turn): a file
    rewritten in place with as many rows is told apart from the one a checkpoint trained on."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.problem, p.answer, p.system]).encode() + b"\n")
    return h.hexdigest()


def prompt_order(n: int, position: int, count: int, seed: int) -> list[int]:
    """Indices of the next `count` of n training problems: a fresh seeded permutation each epoch.
    A pure function of the position in the stream, so a resumed run needs only the position."""
    import torch

    out = []
    while len(out) < count:
        epoch, offset = divmod(position, n)
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        perm = torch.randperm(n, generator=gen).tolist()
        take = perm[offset : offset + count - len(out)]
        out, position = out + take, position + len(take)
    return out


class Choice(NamedTuple):
    prompts: list[int]  # the n prompts to generate for, in data order
    consumed: int  # candidates taken from the data order: advance the data position by this
    skipped: int  # candidates skipped (consumed − n)


def next_prompts(order: Iterator[int], n: int) -> Choice:
    """The plain data order: the next n prompts of `order` (prompt_stream from the data position),
    none skipped. GRESO's skipping (methods/greso.py) replaces it."""
    return Choice(list(itertools.islice(order, n)), n, 0)


def prompt_stream(n: int, position: int, seed: int):
    """`prompt_order`'s stream from `position` on, one index at a time, without end."""
    import torch

    while True:
        epoch, offset = divmod(position, n)
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        yield from torch.randperm(n, generator=gen).tolist()[offset:]
        position += n - offset


def _read_rows(spec: str, data_dir: str | None, limit: int | None) -> tuple[str, list[dict], str]:
    """(source name, raw rows, where-string for error messages)."""
    if spec.startswith("hf:"):
        return spec, _read_hub(spec, limit), spec
    if spec in NAMED:
        if not data_dir:
            raise ValueError(f"benchmark {spec!r} needs data_dir "
                             f"(the folder holding {NAMED[spec]}.jsonl)")
        stem = Path(data_dir) / NAMED[spec]
        found = [p for p in (stem.with_suffix(s) for s in (".jsonl", ".parquet")) if p.exists()]
        path = found[0] if found else None
        if path is None:
            raise FileNotFoundError(f"{stem}.jsonl not found (nor .parquet) for benchmark {spec!r}")
        source = spec
    elif not spec.strip():
        raise ValueError("an empty data spec (a stray comma in a list?)")
    elif spec.endswith((".jsonl", ".parquet")) or Path(spec).exists():
        path, source = Path(spec), Path(spec).stem
    else:
        raise ValueError(f"unknown benchmark {spec!r}; expected tiny, {', '.join(NAMED)}, "
                         "a .jsonl/.parquet path or hf:NAME")
    with open_regular(path) as f:  # a FIFO or a device is refused before anything reads it
        size = os.fstat(f.fileno()).st_size
    if limit is None and size * PARSED_BYTES > machine_memory():
        raise ValueError(f"{path} is {size / 2**30:.1f} GB; parsed, its rows take "
                         f"~{PARSED_BYTES}× that, more than this machine's "
                         f"{machine_memory() / 2**30:.0f} GB")
    rows = _read_parquet(path) if path.suffix == ".parquet" else read_jsonl(path, limit)
    return source, rows[:limit], str(path)


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def open_regular(path: str | Path, max_bytes: int | None = None):
    """`path` opened for binary reading if it is a regular file (or a link to one), else ValueError
    naming it. A FIFO would block the open forever and /dev/zero never ends: both are refused before
    a byte is read (O_NONBLOCK keeps the open itself from waiting). `max_bytes` refuses larger
    files."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found") from None
    except OSError as e:
        raise OSError(f"{path}: {e.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a pipe, device or socket"
        raise ValueError(f"{path} is {kind}, not a regular file")
    if max_bytes is not None and info.st_size > max_bytes:
        os.close(fd)
        raise ValueError(f"{path} is {info.st_size / 2**20:.1f} MB, over the "
                         f"{max_bytes / 2**20:.0f} MB this file may hold")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows of a JSONL file (blank lines skipped); ValueError naming file and line for a bad one."""
    return [row for _, row in jsonl_rows(path, limit)]


def jsonl_rows(path: str | Path, limit: int | None = None) -> list[tuple[int, dict]]:
    """(line number, row) of each JSON object of a JSONL file, blank lines skipped, at most `limit`
    rows. Only a regular file is read, each line at most MAX_LINE bytes; a bad line raises
    ValueError naming file and line."""
    rows = []
    with open_regular(path) as f:
        lineno = 0
        while limit is None or len(rows) < limit:
            line, lineno = f.readline(MAX_LINE + 1), lineno + 1
            if not line:
                break
            if len(line) > MAX_LINE:
                raise ValueError(f"{path}:{lineno}: a line over {MAX_LINE >> 20} MB: not a row")
            row = json_line(line, path, lineno)
            if row is not None:
                rows.append((lineno, row))
    return rows


MAX_YAML_BYTES = 1 << 20  # a config is a few KB: this bounds what a bad or hostile file can cost
MAX_YAML_DEPTH = 32  # nesting of a config (sections are one level, a list two)
MAX_EXPANDED = 4_000_000  # nodes and scalar characters, aliases expanded (a real config: < 10^4)


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses nesting deeper than MAX_YAML_DEPTH while it composes (PyYAML
    composes by recursion: a file nested thousands deep would end in RecursionError)."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        if self.depth > MAX_YAML_DEPTH:
            raise ValueError(f"nested more than {MAX_YAML_DEPTH} levels deep")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _expanded(root) -> tuple[int, int]:
    """(size, depth) of a YAML node graph once every alias is expanded; size counts nodes and scalar
    characters. Aliases share nodes, so each node is measured once (a billion-laughs file is a few
    dozen nodes that expand to 10^9); a node holding an alias of itself is refused. Iterative: an
    alias chain may be long."""
    done, open_, stack = {}, set(), [(root, False)]
    while stack:
        node, measured = stack.pop()
        if id(node) in done:
            continue
        kids = _children(node)
        if measured:
            open_.discard(id(node))
            size = len(node.value) if isinstance(node, yaml.ScalarNode) else 1
            size += sum(done[id(k)][0] for k in kids)
            done[id(node)] = (size, 1 + max((done[id(k)][1] for k in kids), default=0))
            continue
        if id(node) in open_:
            raise ValueError("an alias refers to a node that contains it")
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in done)
    return done[id(root)]


def read_yaml_file(path: str | Path):
    """The YAML document in `path`, loaded under bounds checked before any Python object is built: a
    regular file of at most MAX_YAML_BYTES, nested at most MAX_YAML_DEPTH deep and at most
    MAX_EXPANDED large once aliases are expanded. ValueError naming the file otherwise."""
    with open_regular(path, MAX_YAML_BYTES) as f:
        raw = f.read()
    try:
        loader = _BoundedLoader(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    try:
        node = loader.get_single_node()
        size, depth = _expanded(node) if node is not None else (0, 0)
        if size > MAX_EXPANDED or depth > MAX_YAML_DEPTH:
            raise ValueError(f"its aliases expand to {size:,} nodes and characters, {depth} levels "
                             f"deep (at most {MAX_EXPANDED:,} and {MAX_YAML_DEPTH})")
        return loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    except ValueError as e:  # ours, or a date or an integer of the file that Python cannot build
        raise ValueError(f"{path}: {' '.join(str(e).split())[:300]}") from None
    finally:
        loader.dispose()


def json_line(line: bytes, path, lineno: int) -> dict | None:
    """One JSONL line as an object (None when blank), or ValueError naming file and line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}:{lineno}: not UTF-8 text") from None
    if not text.strip():
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError as e:  # the C decoder checks its depth: nothing is half-built by then
        raise ValueError(f"{path}:{lineno}: JSON nested deeper than Python parses") from e
    except ValueError as e:  # an integer of more than 4300 digits
        raise ValueError(f"{path}:{lineno}: {e}") from None
    if _SURROGATE.search(text) and _lone_surrogate(row):  # every tokenizer and write fails on it
        raise ValueError(f"{path}:{lineno}: a lone UTF-16 surrogate (a \\ud800-\\udfff escape not "
                         "in a pair): not valid Unicode text")
    if not isinstance(row, dict):  # ValueError, as every other bad line (callers catch that)
        got = type(row).__name__
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {got}")  # noqa: TRY004
    return row


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # the escape of a UTF-16 surrogate, paired or not


def _lone_surrogate(row) -> bool:
    """Whether a parsed JSON value holds a surrogate outside a pair (a pair decodes to one
    character): such a string cannot be encoded, tokenized or written."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pandas as pd  # optional: only parquet needs it
    except ImportError:
        raise ImportError(f"reading {path} needs pandas and pyarrow: "
                          "pip install pandas pyarrow") from None
    return pd.read_parquet(path).to_dict("records")


def _read_hub(spec: str, limit: int | None) -> list[dict]:
    try:
        import datasets  # optional: only hub names need it
    except ImportError:
        raise ImportError(f"{spec} needs the `datasets` package: pip install datasets") from None
    name, *rest = spec[3:].split(":")
    config, split = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0] if rest else "train")
    ds = datasets.load_dataset(name, config, split=split)
    return [dict(r) for r in (ds.select(range(min(limit, len(ds)))) if limit is not None else ds)]


def _to_problem(row: dict, i: int, source: str, where: str, problem_key: str | None,
                answer_key: str | None) -> Problem:
    pkeys = [problem_key] if problem_key else ["problem", "question", "prompt"]
    akeys = [answer_key] if answer_key else ["reward_model.ground_truth", "answer", "solution"]
    pkey = next((k for k in pkeys if _get(row, k) is not None), None)
    akey = next((k for k in akeys if _get(row, k) is not None), None)
    if pkey is None or akey is None:
        what, tried = ("problem", pkeys) if pkey is None else ("answer", akeys)
        raise ValueError(f"{where}: row {i} has no {what} field "
                         f"(tried {'/'.join(tried)}; pass {what}_key)")
    problem, answer = _get(row, pkey), _get(row, akey)
    system = ""
    if isinstance(problem, list):  # chat messages: the problem is the last user turn
        turns = [m for m in problem if isinstance(m, dict)]
        system = next((m.get("content") or "" for m in turns if m.get("role") == "system"), "")
        problem = next((m.get("content") for m in reversed(turns) if m.get("role") == "user"), None)
    if not isinstance(problem, str) or _blank(problem):
        raise ValueError(f"{where}: row {i}: the problem ({pkey}) is not a non-empty string")
    problem = _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", problem))
    if isinstance(answer, str) and "####" in answer:  # GSM8K: worked solution, then "#### 70,000"
        answer = answer.rsplit("####", 1)[1]
    elif isinstance(answer, str) and akey == "solution":  # MATH train: the solution's last \boxed{}
        answer = last_boxed(answer) or answer
    rid = row.get("id", row.get("unique_id"))
    text = _as_text(answer)
    if text is None:  # a null (NaN in parquet), a bool, a list: never a reward to learn \boxed{nan}
        raise ValueError(f"{where}: row {i}: the gold answer ({akey}) must be a non-empty string "
                         f"or a finite number, got {str(answer)[:40]!r}")
    rid = f"{source}-{i}" if rid is None else str(rid)
    return Problem(problem.strip(), text, rid, source, system)


def _refuse_two_golds(problems: list[Problem], where: str) -> None:
    """A problem given twice with two gold answers rewards one of them as wrong: refused."""
    first = {}
    for i, p in enumerate(problems):
        j = first.setdefault(p.problem, i)
        if problems[j].answer != p.answer:
            raise ValueError(f"{where}: rows {j} and {i} give one problem two gold answers "
                             f"({problems[j].answer[:20]!r}, {p.answer[:20]!r}); keep one")


def _blank(text: str) -> bool:
    """Whether `text` shows nothing: only spaces, controls and invisible format characters (a
    zero-width space, a byte-order mark), which str.strip() keeps."""
    return all(ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf", "Zs") for ch in text)


def _get(row: dict, key: str):
    """A field or None; a dotted key reads a nested dict ("reward_model.ground_truth")."""
    value = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if hasattr(value, "tolist"):  # parquet gives numpy arrays and scalars
        return value.tolist()
    return value


def _as_text(value) -> str | None:
    """The gold answer as text, or None when it is not a non-empty string or a finite number."""
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        return None
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, str):
        return None if _blank(value) else value.strip()
    if not math.isfinite(value):
        return None
    if float(value).is_integer():  # AMC stores 27.0: the integer it means
        return str(int(value))
    return repr(float(value))


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text`, nested braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{") - 1
    for j in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[begin + 1 : j]
    return None
