"""Bad input, round three (#27), one test per class, several members each: chat templates that
refuse or break, values that cannot be allocated or never finish, config and data bombs, malformed
RLEP sources (and broken model folders, --compare run folders). Each member: exit 2, one line on
stderr, no traceback, nothing written into the run folder (a previous run in it and --overwrite: the
worst case). --debug shows the traceback of what caused it.

  pytest -q tests/test_bad_input.py        # ~6 min on 2 busy cores
  pytest -q tests/test_bad_input.py -k "bombs or values"
"""

import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from fixtures import previous_run, snapshot

import eval as ev
import train
from analysis import compare

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = REPO / "data" / "tiny_model"
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}
BASE = [
    "--config",
    str(REPO / "configs" / "tiny.yaml"),
    f"--model.path={MODEL}",
    "--threads=1",
    "--wandb.mode=disabled",
    "--rollout.group_size=4",
    "--rollout.batch_size=16",
    "--eval.n=4",
    "--eval.k=1",
    "--max_steps=1",
]
needs_model = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="no tiny model")


def refused(tmp_path: Path, capsys, *args: str) -> str:
    """train.main on a previous run with --overwrite: exit 2, one stderr line, no traceback, the run
    intact. Returns the line."""
    out = tmp_path / "run"
    before = previous_run(out)
    assert train.main([*BASE, f"--out_dir={out}", "--overwrite", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    assert snapshot(out) == before
    return err


def run_script(tmp_path: Path, script: str, *args: str, timeout: int = 120):
    """`python script args` in a subprocess (a hang fails the test after `timeout` seconds)."""
    cmd = [sys.executable, str(REPO / script), *args]
    return subprocess.run(
        cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout, check=False
    )


def assert_one_line(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "error: " in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


EVAL = ["--model", str(MODEL), "--benchmarks", "tiny", "--max-new-tokens", "4"]


def eval_refused(capsys, tmp_path: Path, *args: str) -> str:
    """eval.main in this process: exit 2, one stderr line, no traceback, nothing written."""
    with pytest.raises(SystemExit) as e:
        ev.main([*EVAL, "--out-dir", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    return err


def debug_chain(argv: list[str]) -> str:
    """The traceback train.main --debug raises, as printed (the exceptions it chains included)."""
    with pytest.raises((train.RunError, train.ConfigError)) as e:
        train.main([*argv, "--debug"])
    return "".join(traceback.format_exception(e.value))


# ---------------------------------------------------------------------------------- chat templates


def model_with_template(tmp_path: Path, name: str, template: bytes | str) -> Path:
    folder = tmp_path / name
    shutil.copytree(MODEL, folder)
    data = template.encode() if isinstance(template, str) else template
    (folder / "chat_template.jinja").write_bytes(data)
    return folder


GEMMA = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
)
TEMPLATES = [  # (name, template, system prompt, what the line must say)
    (
        "gemma",
        GEMMA,
        "Be brief.",
        [
            "refuses the conversation: 'System role not supported'",
            "data.system_prompt=",
            "data.chat_template=false",
        ],
    ),
    (
        "syntax",
        "{% for m in messages %}{{ m['content'] }",
        "",
        ["does not parse (unexpected '}'", "data.chat_template=false"],
    ),
    (
        "alternate",
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
        "",
        [
            "refuses the conversation: 'Conversation roles must alternate",
            "data.chat_template=false",
        ],
    ),
    ("zerodiv", "{{ 1 / 0 }}", "", ["fails (ZeroDivisionError: division by zero)"]),
    ("undefined", "{{ messages[5].content.upper() }}", "", ["fails (UndefinedError"]),
    ("not_a_test", "{% if messages is nosuchtest %}x{% endif %}", "", ["its chat template"]),
]


@needs_model
@pytest.mark.parametrize("name, template, system, words", TEMPLATES, ids=[t[0] for t in TEMPLATES])
def test_bad_input_chat_template(tmp_path, capsys, name, template, system, words):
    folder = model_with_template(tmp_path, name, template)
    line = refused(tmp_path, capsys, f"--model.path={folder}", f"--data.system_prompt={system}")
    assert f"model.path {folder}: its chat template" in line
    for w in words:
        assert w in line


@needs_model
def test_bad_input_chat_template_system_turn_from_the_data(tmp_path, capsys):
    """Rows that carry their own system turn (chat-format data) and a template that refuses it."""
    rows = tmp_path / "chat.jsonl"
    turns = [{"role": "system", "content": "Think."}, {"role": "user", "content": "1+1"}]
    rows.write_text(json.dumps({"prompt": turns, "answer": "2"}) + "\n")
    folder = model_with_template(tmp_path, "gemma", GEMMA)
    line = refused(tmp_path, capsys, f"--model.path={folder}", f"--data.train={rows}")
    assert "the data's rows carry a system turn: set data.chat_template=false" in line


@needs_model
def test_bad_input_chat_template_end_to_end_and_debug(tmp_path, capsys):
    folder = model_with_template(tmp_path, "gemma", GEMMA)
    out = tmp_path / "run"
    args = [*BASE, f"--model.path={folder}", "--data.system_prompt=Hi", f"--out_dir={out}"]
    r = run_script(tmp_path, "train.py", *args)
    assert_one_line(r, "System role not supported", "data.system_prompt")
    assert not out.exists()
    gemma = ["--model", str(folder), "--system-prompt", "Hi", "--k", "1", "--limit", "2"]
    r = run_script(tmp_path, "eval.py", *EVAL, *gemma, "--out-dir", str(out))
    assert_one_line(r, "System role not supported", "--system-prompt ''", "--no-chat-template")
    assert "--system-prompt ''" in eval_refused(capsys, tmp_path, *gemma)
    with pytest.raises(ev.BadInput) as e:
        ev.main([*EVAL, *gemma, "--out-dir", str(out), "--debug"])
    text = "".join(traceback.format_exception(e.value))
    assert "jinja2.exceptions.TemplateError: System role not supported" in text
    text = debug_chain(args)
    assert "jinja2.exceptions.TemplateError: System role not supported" in text
    assert "support.util.RunError" in text and not out.exists()


@needs_model
def test_bad_input_chat_template_that_drops_the_system_turn_warns(tmp_path, capsys):
    drop = (
        "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}"
        "{% endfor %}"
    )
    folder = model_with_template(tmp_path, "drops", drop)
    args = [*BASE, f"--model.path={folder}", "--data.system_prompt=Be brief.", "--max_steps=0"]
    assert train.main([*args, f"--out_dir={tmp_path / 'run'}"]) == 0
    err = capsys.readouterr().err
    assert f"warning: model.path {folder}: its chat template leaves out the system turn" in err


@needs_model
@pytest.mark.parametrize(
    "broken", ["binary_template", "fifo_template", "fifo_config", "deep_config"]
)
def test_bad_input_model_folder_with_broken_files(tmp_path, capsys, broken):
    folder = model_with_template(tmp_path, "model", "{{ messages[0]['content'] }}")
    name = "chat_template.jinja" if broken.endswith("template") else "config.json"
    (folder / name).unlink()
    if broken.startswith("fifo"):
        os.mkfifo(folder / name)  # transformers would wait forever for a writer
    else:
        (folder / name).write_bytes(
            b"\xff\xfe{{ \x00" if broken == "binary_template" else b"[" * 100_000
        )
    line = refused(tmp_path, capsys, f"--model.path={folder}")
    assert f"model.path {folder}: " in line


# ---------------------------------------------------- values that cannot be allocated or never end


def eval_file(tmp_path: Path, n: int) -> Path:
    f = tmp_path / "held_out.jsonl"
    f.write_text(
        "".join(json.dumps({"problem": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(n))
    )
    return f


VALUES = [  # (override(s), what the line must say)
    (
        ["--replay.strategy=uniform", "--replay.capacity=1000000000000"],
        "replay.capacity must be smaller: ~1e+12 replay.capacity × 661 bytes a slot",
    ),
    (["--threads=100000000000"], "threads must be in [0, 1024]"),
    (["--seed=4294967296"], "seed must be in [0, 2^32)"),
    ([f"--seed={10**30}"], "seed must be in [0, 2^32)"),
    (
        ["--eval.k=100000000"],
        "eval.k must be smaller: 4 eval problems × 100,000,000 eval.k = 400,000,000 samples",
    ),
    (["--eval.n=1000000000"], "eval.n must be smaller"),
    (["--rollout.dynamic_sampling=1000000000"], "rollout.dynamic_sampling must be smaller"),
    (["--rollout.max_new_tokens=1000000000"], "rollout.max_new_tokens must be smaller"),
    (
        ["--rollout.batch_size=1000000000", "--rollout.group_size=2"],
        "rollout.batch_size must be smaller",
    ),
    (
        ["--max_steps=1000000000000"],
        "max_steps must be smaller: ~1e+12 max_steps × 16 rollout.batch_size",
    ),
    (["--data.tiny.train_size=1000000000"], "data.tiny.train_size must be in [1, 13,041]"),
    (
        ["--data.tiny.train_size=100000000", "--data.tiny.max_int=1000000000"],
        "fit in this machine's memory",
    ),
    (["--data.tiny.kinds=add:-1,mul:nan"], "data.tiny.kinds must be kind:weight pairs"),
    (["--reward.workers=1000000"], "reward.workers must be an integer in [1, 256]"),
    ([f"--reward.timeout={10**400}"], "reward.timeout must be > 0 and finite"),
    (
        ["--eval.n=0", "--eval.k=100000", "EVAL_FILE"],
        "eval.k must be smaller: 200 eval problems × 100,000 eval.k",
    ),
]


@pytest.mark.parametrize("args, words", VALUES, ids=[" ".join(v[0])[:60] for v in VALUES])
def test_bad_input_values_that_cannot_be_allocated_or_never_finish(tmp_path, capsys, args, words):
    if (
        "EVAL_FILE" in args
    ):  # the eval set's size is known once it is loaded: refused then, still before out_dir
        if not (MODEL / "config.json").is_file():
            pytest.skip("needs the tiny model")
        args = [a for a in args if a != "EVAL_FILE"] + [f"--data.eval={eval_file(tmp_path, 200)}"]
    assert words in refused(tmp_path, capsys, *args)


def test_bad_input_values_end_to_end_and_debug(tmp_path):
    out = tmp_path / "run"
    args = ["--replay.strategy=aper", "--replay.capacity=1000000000000"]
    r = run_script(tmp_path, "train.py", *BASE, *args, f"--out_dir={out}")
    assert_one_line(r, "bytes of replay buffer")
    r = run_script(
        tmp_path, "eval.py", *EVAL, "--limit", "300", "--k", "100000", "--out-dir", str(out)
    )
    assert_one_line(r, "30,000,000 samples")
    assert not out.exists()
    text = debug_chain([*BASE, "--eval.k=100000000", f"--out_dir={out}"])
    assert "Traceback" in text and "ConfigError: eval.k must be smaller" in text


EVAL_VALUES = [
    (["--limit", "300", "--k", "100000"], "= 30,000,000 samples"),
    (["--limit", "1", "--k", "100000000"], "100,000,000 samples"),
    (["--limit", "500", "--max-new-tokens", "100000000"], "and 400,000,000,000 tokens"),
    (["--seed", str(2**32)], "--seed must be in [0, 2^32)"),
    (["--seed", "-1"], "--seed must be in [0, 2^32)"),
    (["--limit", "100000000"], "100,000,000 test problems asked, at most 13,541"),
]


@pytest.mark.parametrize("args, words", EVAL_VALUES, ids=[" ".join(v[0]) for v in EVAL_VALUES])
def test_bad_input_values_eval(tmp_path, capsys, args, words):
    assert words in eval_refused(capsys, tmp_path, *args)


def test_bad_input_eval_save_correct_under_a_file(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file, not a folder\n")
    saved = tmp_path / "taken" / "phase1.jsonl"
    err = eval_refused(capsys, tmp_path, "--save-correct", str(saved))
    assert "a folder on its path is a file" in err
    assert (tmp_path / "taken").read_text() == "a file, not a folder\n"


# --------------------------------------------------------------------------- config and data bombs


def alias_bomb(mapping: bool) -> str:
    """Billion laughs: nine levels of nine aliases each, 9^9 leaves once expanded, in a few hundred
    bytes."""
    if mapping:
        lines = ["a0: &a0 {" + ", ".join(f"k{j}: lol" for j in range(9)) + "}"]
        lines += [
            f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(9)) + "}"
            for i in range(1, 9)
        ]
        return "\n".join(lines) + "\noptim: *a8\n"
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\nrollout: {stop_tokens: *a8}\n"


def config_bomb(tmp_path: Path, kind: str) -> str:
    """A config file (or a path standing for one) of the given hostile kind."""
    f = tmp_path / f"{kind}.yaml"
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "device":
        return "/dev/zero"
    elif kind == "folder":
        return str(tmp_path)
    elif kind == "chain":  # base: chains 20 files deep
        for i in range(20):
            (tmp_path / f"c{i}.yaml").write_text(
                f"base: c{i + 1}.yaml\n" if i < 19 else "seed: 1\n"
            )
        return str(tmp_path / "c0.yaml")
    else:
        f.write_text(
            {
                "bomb_map": alias_bomb(True),
                "bomb_list": alias_bomb(False),
                "deep_flow": "seed: " + "[" * 5000 + "]" * 5000 + "\n",
                "deep_block": "".join("  " * i + f"k{i}:\n" for i in range(200))
                + "  " * 200
                + "x: 1\n",
                "self_alias": "a: &a {b: *a}\noptim: *a\n",
                "big_int": "seed: " + "9" * 5000 + "\n",
                "bad_date": "seed: 2001-13-45\n",
                "long_alias": "a: &a "
                + "x" * 400_000
                + "\nrollout: {stop_tokens: ["
                + ", ".join(["*a"] * 50)
                + "]}\n",
            }[kind]
        )
    return str(f)


def bomb_size(mapping: bool) -> int:
    """The expanded size of alias_bomb by hand: nodes plus scalar characters. a0 holds 9 scalars
    (mapping: 9 two-character keys and 9 "lol"); each a_i nine copies of a_(i-1); the root adds its
    keys and the last."""
    size = [1 + 9 * (2 + 3)] if mapping else [1 + 9 * 3]
    for _ in range(8):
        size.append(1 + 9 * (2 + size[-1]) if mapping else 1 + 9 * size[-1])
    tail = len("optim") + size[8] if mapping else len("rollout") + 1 + len("stop_tokens") + size[8]
    return 1 + sum(2 + s for s in size) + tail


CONFIGS = [
    ("bomb_map", f"aliases expand to {bomb_size(True):,} nodes and characters, 11 levels deep"),
    ("bomb_list", f"aliases expand to {bomb_size(False):,} nodes and characters, 12 levels deep"),
    ("deep_flow", "nested more than 32 levels deep"),
    ("deep_block", "nested more than 32 levels deep"),
    ("self_alias", "an alias refers to a node that contains it"),
    ("big_int", "4300 digits"),
    ("bad_date", "month must be in 1..12"),
    ("long_alias", "aliases expand to 20,"),
    ("fifo", "not a regular file"),
    ("device", "/dev/zero is a pipe, device or socket"),
    ("folder", "is a folder, not a regular file"),
    ("chain", "a `base` chain of more than 16 files"),
]


@pytest.mark.parametrize("kind, words", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_bad_input_config_bombs(tmp_path, capsys, kind, words):
    line = refused(tmp_path, capsys, "--config", config_bomb(tmp_path, kind))
    assert line.startswith("error: config file ") and words in line


def data_bomb(tmp_path: Path, kind: str) -> str:
    """A data file (or a path standing for one) of the given hostile kind."""
    f = tmp_path / f"{kind}.jsonl"
    good = json.dumps({"problem": "1+1", "answer": "2"}) + "\n"
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "device":
        return "/dev/zero"
    elif kind == "folder":
        (tmp_path / "folder.jsonl").mkdir()
    elif kind == "empty_spec":
        return "tiny,"
    else:
        f.write_bytes(
            good.encode()
            + {
                "deep": b"[" * 100_000 + b"]" * 100_000 + b"\n",
                "deep_object": b'{"problem": '
                + b'{"a": ' * 50_000
                + b"1"
                + b"}" * 50_000
                + b', "answer": "2"}\n',
                "not_utf8": b'{"problem": "\xff\xfe", "answer": "2"}\n',
                "big_int": b'{"problem": "1+1", "answer": ' + b"9" * 5000 + b"}\n",
                "string_row": b'"just a string"\n',
            }[kind]
        )
    return str(f)


DATA = [
    ("fifo", "fifo.jsonl is a pipe, device or socket, not a regular file"),
    ("device", "/dev/zero is a pipe, device or socket"),
    ("folder", "folder.jsonl is a folder"),
    ("deep", "deep.jsonl:2: JSON nested deeper than Python parses"),
    ("deep_object", "deep_object.jsonl:2: JSON nested deeper than Python parses"),
    ("not_utf8", "not_utf8.jsonl:2: not UTF-8 text"),
    ("big_int", "big_int.jsonl:2: Exceeds the limit"),
    ("string_row", "string_row.jsonl:2: expected a JSON object, got str"),
    ("empty_spec", "an empty data spec"),
]


@pytest.mark.parametrize("kind, words", DATA, ids=[d[0] for d in DATA])
@pytest.mark.parametrize("key", ["data.train", "data.eval"])
def test_bad_input_data_bombs(tmp_path, capsys, kind, words, key):
    if key == "data.train" and kind == "empty_spec":
        pytest.skip("data.train is one spec")
    line = refused(tmp_path, capsys, f"--{key}={data_bomb(tmp_path, kind)}")
    assert line.startswith("error: data: ") and words in line


def test_bad_input_bombs_end_to_end_and_debug(tmp_path, capsys):
    out = tmp_path / "run"
    bomb = config_bomb(tmp_path, "bomb_map")
    r = run_script(tmp_path, "train.py", "--config", bomb, f"--out_dir={out}")
    assert_one_line(r, "aliases expand to")
    fifo = data_bomb(tmp_path, "fifo")
    r = run_script(tmp_path, "eval.py", *EVAL, "--benchmarks", fifo, "--out-dir", str(out))
    assert_one_line(r, "fifo.jsonl is a pipe, device or socket")  # its open used to block forever
    for spec in ("/dev/zero", data_bomb(tmp_path, "deep"), data_bomb(tmp_path, "not_utf8")):
        assert Path(spec).name in eval_refused(capsys, tmp_path, "--benchmarks", spec)
    assert not out.exists()
    text = debug_chain([*BASE, f"--data.train={data_bomb(tmp_path, 'deep')}", f"--out_dir={out}"])
    assert "RecursionError" in text and "support.util.RunError: data: " in text
    text = debug_chain(["--config", config_bomb(tmp_path, "deep_flow"), f"--out_dir={out}"])
    assert "nested more than 32 levels deep" in text and "Traceback" in text


COMPARE = [
    ("summary.json", "[1, 2]", "summary.json:1: expected a JSON object, got list"),
    ("summary.json", '{"strategy": ["x"]}', "summary.json: strategy must be str"),
    ("summary.json", "[" * 100_000 + "]" * 100_000, "summary.json:1: JSON nested deeper"),
    (
        "metrics.jsonl",
        '{"step": 1, "generated_tokens": 5}\n[1]\n',
        "metrics.jsonl:2: expected a JSON object",
    ),
    (
        "metrics.jsonl",
        '{"step": "one", "generated_tokens": 5}\n',
        "metrics.jsonl:1: step must be int",
    ),
    ("metrics.jsonl", '{"eval/accuracy": 0.5}\n', "metrics.jsonl:1: a row without step"),
    ("metrics.jsonl", "FIFO", "metrics.jsonl is a pipe, device or socket"),
    ("config.yaml", "replay: [1]\n", "config.yaml: not a run's config"),
    ("config.yaml", alias_bomb(True), "config.yaml: its aliases expand to"),
]


@pytest.mark.parametrize(
    "name, content, words", COMPARE, ids=[f"{c[0]}-{i}" for i, c in enumerate(COMPARE)]
)
def test_bad_input_compare_run_folders(tmp_path, capsys, name, content, words):
    run = tmp_path / "none-s0"
    run.mkdir()
    (run / "summary.json").write_text('{"strategy": "none", "seed": 0}')
    (run / name).unlink(missing_ok=True)
    if content == "FIFO":
        os.mkfifo(run / name)
    else:
        (run / name).write_text(content)
    with pytest.raises(SystemExit) as e:
        compare.main([str(run), "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="nested|expected|must be|without|not a|aliases|device"):
        compare.main([str(run), "--out-dir", str(tmp_path / "out"), "--debug"])


# -------------------------------------------------------------------------- malformed RLEP sources

GOOD_ROW = {"prompt_idx": 0, "completion_ids": [5, 6, 7], "behav_logp": [-0.5, -0.25, -1.0]}
RLEP = [  # (the second line of the source, or a .meta.json, what the line must say)
    ("[1, 2]", None, ":2: expected a JSON object, got list"),
    ('"a solution"', None, ":2: expected a JSON object, got str"),
    ("42", None, ":2: expected a JSON object, got int"),
    (
        {"prompt_idx": 0, "completion_ids": [[5, 6], [7]]},
        None,
        ":2: completion_ids must be a non-empty list",
    ),
    (
        {"prompt_idx": 0, "completion_ids": ["5", "6"]},
        None,
        ":2: completion_ids must be a non-empty list",
    ),
    (
        {"prompt_idx": 0, "completion_ids": [10**12]},
        None,
        ":2: completion_ids must be a non-empty list of token ids",
    ),
    ({"prompt_idx": 0, "completion_ids": []}, None, ":2: completion_ids must be a non-empty list"),
    (
        {"prompt_idx": 10**9, "completion_ids": [5]},
        None,
        ":2: prompt_idx must be an integer in [0, 2000), got 1000000000",
    ),
    (
        {"prompt_idx": -1, "completion_ids": [5]},
        None,
        ":2: prompt_idx must be an integer in [0, 2000), got -1",
    ),
    (
        {"prompt_idx": True, "completion_ids": [5]},
        None,
        ":2: prompt_idx must be an integer in [0, 2000), got true",
    ),
    (
        {"prompt_idx": "0", "completion_ids": [5]},
        None,
        ':2: prompt_idx must be an integer in [0, 2000), got "0"',
    ),
    (
        {"problem": {"text": "1+1"}, "completion_ids": [5]},
        None,
        ":2: problem must be its text",
    ),
    (
        {"problem": "not a training problem", "completion_ids": [5]},
        None,
        ":2: problem is not among the training",
    ),
    ({"prompt_idx": 0, "completion": 7}, None, ":2: completion_ids must be a non-empty list"),
    (
        {"prompt_idx": 0, "completion_ids": [5], "behav_logp": "low"},
        None,
        ":2: behav_logp must be a list",
    ),
    (
        {"prompt_idx": 0, "completion_ids": [5], "behav_logp": [[-0.1]]},
        None,
        ":2: behav_logp must be a list",
    ),
    (
        {"prompt_idx": 0, "completion_ids": [5], "behav_logp": [3.0]},
        None,
        ":2: behav_logp must be a list",
    ),
    ("[" * 100_000 + "]" * 100_000, None, ":2: JSON nested deeper than Python parses"),
    (GOOD_ROW, "[1, 2]", ".meta.json:1: expected a JSON object, got list"),
    (GOOD_ROW, '"many"', ".meta.json:1: expected a JSON object, got str"),
    (
        GOOD_ROW,
        '{"generated_tokens": -5}',
        ".meta.json: generated_tokens must be an integer ≥ 0, got -5",
    ),
    (
        GOOD_ROW,
        '{"generated_tokens": "lots"}',
        '.meta.json: generated_tokens must be an integer ≥ 0, got "lots"',
    ),
    (
        GOOD_ROW,
        '{"generated_tokens": 1e400}',
        ".meta.json: generated_tokens must be an integer ≥ 0, got Infinity",
    ),
    (GOOD_ROW, "FIFO", ".meta.json is a pipe, device or socket, not a regular file"),
    ("FIFO", None, "phase1.jsonl is a pipe, device or socket, not a regular file"),
]


def rlep_source(tmp_path: Path, second, meta) -> Path:
    f = tmp_path / "phase1.jsonl"
    if second == "FIFO":
        os.mkfifo(f)
        return f
    line = second if isinstance(second, str) else json.dumps(second)
    f.write_text(json.dumps(GOOD_ROW) + "\n" + line + "\n")
    if meta == "FIFO":
        os.mkfifo(tmp_path / "phase1.jsonl.meta.json")
    elif meta is not None:
        (tmp_path / "phase1.jsonl.meta.json").write_text(meta)
    return f


@needs_model
@pytest.mark.parametrize(
    "second, meta, words", RLEP, ids=[f"{i}-{str(r[0])[:20]}-{r[1]}" for i, r in enumerate(RLEP)]
)
def test_bad_input_rlep_source(tmp_path, capsys, second, meta, words):
    f = rlep_source(tmp_path, second, meta)
    line = refused(tmp_path, capsys, "--replay.strategy=rlep", f"--replay.rlep_source={f}")
    assert line.startswith(f"error: replay: {f}") and words in line


@needs_model
def test_bad_input_rlep_source_end_to_end_and_debug(tmp_path):
    f = rlep_source(tmp_path, {"prompt_idx": 0, "completion_ids": [[5, 6]]}, None)
    out = tmp_path / "run"
    args = [*BASE, "--replay.strategy=rlep", f"--replay.rlep_source={f}", f"--out_dir={out}"]
    r = run_script(tmp_path, "train.py", *args)
    assert_one_line(r, f"{f}:2: completion_ids must be a non-empty list of token ids")
    assert not out.exists()
    text = debug_chain(args)
    assert "read_rlep_source" in text and "support.util.RunError: replay: " in text
    f.unlink()
    f = rlep_source(tmp_path, GOOD_ROW, '{"generated_tokens": 123}')  # a good source still loads
    args = [*BASE, "--replay.strategy=rlep", f"--replay.rlep_source={f}", "--max_steps=0"]
    assert train.main([*args, f"--out_dir={tmp_path / 'good'}"]) == 0
    summary = json.loads((tmp_path / "good" / "summary.json").read_text())
    assert summary["tokens_generated_total"] == 123  # phase I's tokens, read from the .meta.json
