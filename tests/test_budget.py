"""bench/budget.py (issue #28's figures) on a small hand-made tree: each detector, the exit code."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import REPO  # (tests/fixtures.py: the repository's root)
sys.path.insert(0, str(REPO / "bench"))
import budget

SMALL = '''"""A module docstring
over two lines."""

# a comment line is not counted

import os


def f(x):
    """One line."""
    return os.path.join(x,
                        "y")  # a comment after code: counted
'''


def write_tree(root: Path, train: str = SMALL) -> Path:
    (root / "support").mkdir(exist_ok=True)
    for name in ["train.py", "grpo.py", "replay.py", "rollout.py", "config.py", "rewards.py",
                 "eval.py", "support/models.py"]:
        (root / name).write_text(SMALL)
    (root / "train.py").write_text(train)
    return root


def test_budget_counts_code_lines_with_docstrings():
    # lines 1-2 (docstring), 6 (import), 9-12 (def, docstring, the call over two lines): 7
    assert budget.code_lines(SMALL) == [1, 2, 6, 9, 10, 11, 12]
    blank_in_string = 'x = """a\n\nb"""\n'
    assert budget.code_lines(blank_in_string) == [1, 3]  # a blank line inside a string is blank


def test_budget_detectors_on_a_synthetic_tree(tmp_path):
    body = "\n".join(f"    y{i} = {i}" for i in range(60))
    bad = (SMALL + "\n\ndef long():\n" + body + "\n"  # def + 60 lines: 61
           + "\n\ndef g(a, b):\n"
           + "    a.close() if a else None\n"  # a conditional expression as a statement
           + "    [print(m) for m in b]\n"  # a comprehension run for its side effect
           + "    a.x(), b.y()\n"  # a tuple of calls
           + "    {k: 1 for k in b}\n"
           + "    return a if b else None  # noqa: E501\n"  # an expression, not a statement
           + "# " + "x" * 100 + "\n")  # 102 characters
    root = write_tree(tmp_path, bad)
    sandbox = "try:\n    pass\nexcept Exception:  # noqa: BLE001\n    pass\n"
    (root / "rewards.py").write_text(SMALL + sandbox)
    m = budget.measure(root / "train.py")
    assert m["statements"] == [(79, "IfExp"), (80, "ListComp"), (81, "Tuple"), (82, "DictComp")]
    tree = budget.ast.parse("(x for x in y)\n{x for x in y}\nf(x)\n")
    others = budget.statement_expressions(tree)
    assert others == [(1, "GeneratorExp"), (2, "SetComp")]  # a plain call is fine
    assert m["noqa"] == [(83,)] and m["long_lines"] == [84]
    assert m["functions"] == [(15, "long", 61)]
    assert budget.measure(root / "rewards.py")["noqa"] == []  # the verifier's sandbox is exempt
    counted = budget.code_lines(bad)
    assert m["chars"] == sum(len(bad.splitlines()[n - 1].rstrip()) for n in counted)
    assert m["lines"] == 7 + 61 + 6
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "budget.py"), "--root", str(root)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr  # figures only, by default
    out = proc.stdout
    assert "conditional expressions, comprehensions, tuples as statements: 4" in out
    assert "train.py:81:Tuple" in out and "functions over 60 lines: 1" in out
    assert "# noqa outside rewards.py: 1" in out and "lines over 100 characters: 1" in out
    reading = next(line for line in out.splitlines() if line.startswith("reading path"))
    assert reading.split()[-3:] == [str(7 * 3 + 74), str(budget.READING_BUDGET), "ok"]
    check = subprocess.run([sys.executable, str(REPO / "bench" / "budget.py"), "--root", str(root),
                            "--check"], capture_output=True, text=True, check=False)
    assert check.returncode == 1 and "4 target(s) missed" in check.stdout


def test_budget_check_passes_on_a_clean_tree_and_counts_each_support_module(tmp_path):
    root = write_tree(tmp_path)
    (root / "support" / "big.py").write_text("x = 1\n" * 301)  # each module of support/: ≤ 300
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "budget.py"), "--root", str(root),
                           "--check"], capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    big = next(line for line in proc.stdout.splitlines() if line.startswith("support/big.py "))
    assert big.split()[-3:] == ["301", "300", "MISSED"]
    (root / "support" / "big.py").unlink()
    (root / "grpo.py").unlink()
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "budget.py"), "--root", str(root),
                           "--check"], capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "(no grpo.py)" in proc.stdout  # a missing file misses
    write_tree(root)
    (root / "README.md").write_text("line\n" * 251)  # the README: ≤ 250 lines
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "budget.py"), "--root", str(root),
                           "--check"], capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "251     250  MISSED" in proc.stdout
    (root / "README.md").write_text("line\n" * 250)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "budget.py"), "--root", str(root),
                           "--check"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "0 target(s) missed" in proc.stdout


def test_budget_imports_no_module_imports_train_and_grpo_imports_no_config(tmp_path):
    root = write_tree(tmp_path)
    (root / "grpo.py").write_text("import torch\nfrom config import Config\n")
    (root / "replay.py").write_text("import train\nfrom train import Run\n")
    assert budget.measure(root / "grpo.py")["imports"] == [(2, "config")]
    assert budget.measure(root / "replay.py")["imports"] == [(1, "train"), (2, "train")]
    (root / "eval.py").write_text("from config import MAX_STEPS\n")  # config is fine elsewhere
    assert budget.measure(root / "eval.py")["imports"] == []


def test_budget_imports_of_this_repository():
    """The real tree: nothing imports train.py, grpo.py imports no config class."""
    for _, names, _ in budget.subjects(REPO):
        for name in names:
            if (REPO / name).is_file():
                assert budget.measure(REPO / name)["imports"] == [], name


def owned(path: Path) -> bool:
    """A file of this repository: not in a run folder, a hidden folder (.venv) or a venv."""
    ignored = {"runs", "wandb", "site-packages"}
    return not any(part.startswith(".") or part in ignored for part in path.parts[:-1])


def test_every_python_file_keeps_lines_of_at_most_100_characters():
    """The 100-character line length holds beyond the reading path: tests, bench, data/ too."""
    files = [p for p in sorted(REPO.rglob("*.py")) if owned(p.relative_to(REPO))]
    long = []
    for p in files:  # budget.py's own detector, over every file rather than the reading path
        long += [f"{p.relative_to(REPO)}:{n}" for n in budget.measure(p)["long_lines"]]
    assert long == [], long[:20]


def test_readmes_reading_order_gives_each_files_counted_lines():
    """README's reading-order table says how many lines each file counts (as bench/budget.py
    counts them): the figures stay true as the files change."""
    table = r"^\| `(\w+\.py)` \| (\d+) \|"  # | `train.py` | 344 | ...
    rows = re.findall(table, (REPO / "README.md").read_text(), re.MULTILINE)
    assert len(rows) >= 5
    for name, lines in rows:
        assert budget.measure(REPO / name)["lines"] == int(lines), name


def test_an_ordinary_default_step_runs_four_support_modules_and_no_method():
    """#48's and #57's figures, by trace (bench/trace_step.py): one step of the default run that
    is neither the first nor an eval's or a checkpoint's enters 4 support/ modules (generation's
    KV cache apart from the chunked head; the phase timer in metrics.py, the train/eval mode
    switch in support/logprobs.py) and no function of methods/ (every method is off); the
    reading path does the rest."""
    import trace_step

    entered = trace_step.trace("configs/tiny.yaml", [])
    for module in ("train.py", "rollout.py", "grpo.py", "replay.py", "rewards.py"):
        assert module in entered, module  # the tracer saw the step
    assert "update_policy" in entered["grpo.py"] and "policy_logprobs" in entered["grpo.py"]
    support = trace_step.support_modules(entered)
    expected = ["support/kvcache.py", "support/logprobs.py", "support/parallel.py",
                "support/preempt.py"]
    assert support == expected, support
    methods = {m: f for m, f in entered.items() if m.startswith("methods/")}
    assert methods == {}, f"a method that is off ran in the default step: {methods}"


def test_a_method_that_is_on_is_in_the_step():
    """The other side of the trace: with SFPO on, its update runs (the tracer would see a method
    that is on)."""
    import trace_step

    entered = trace_step.trace("configs/tiny.yaml", ["--lookahead.method=sfpo",
                                                     "--lookahead.fast_steps=1"])
    assert "SFPO.__call__" in entered.get("methods/lookahead.py", set())
    assert trace_step.methods_entered(entered) > 0


def test_only_train_py_imports_methods_on_the_reading_path():
    """#57: the methods a researcher compares are composed by train.py at set-up; batch, rollout,
    grpo, replay, rewards, eval and metrics import nothing from methods/ (config.py gathers each
    method's config section, which lives beside the method)."""
    for name in ("batch.py", "rollout.py", "grpo.py", "replay.py", "rewards.py", "eval.py",
                 "metrics.py"):
        assert "methods" not in reading_path_imports(REPO / name), name
    assert "methods" in reading_path_imports(REPO / "train.py")


def reading_path_imports(path: Path) -> set[str]:
    """The reading-path and package modules that `path` imports (at any depth of the file)."""
    import ast

    tree = ast.parse(path.read_text())
    tops = {"train", "rollout", "grpo", "replay", "rewards", "config", "eval", "methods",
            "analysis"}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found & tops


def test_support_imports_nothing_above_it():
    """support/ is scale and I/O under the reading path: none of its modules imports train,
    rollout, grpo, replay, rewards, config, eval, methods or analysis (support/vllm.py returns
    batch.py's Rollouts, and rollout.make_sampler hands it the sampling distribution)."""
    found = {}
    for f in sorted((REPO / "support").glob("*.py")):
        imports = reading_path_imports(f)
        if imports:
            found[f.name] = imports
    assert found == {}


def test_long_lines_counts_characters_not_bytes_and_allows_exactly_100(tmp_path):
    """Guards budget.measure's long_lines at its edge: a line of 100 characters is fine, 101 is
    not, whether ASCII or not (é, π: one character each, two bytes each), and a comment's
    characters count as code's do."""
    lines = ["x = '" + "a" * 94 + "'", "x = '" + "a" * 95 + "'", "x = '" + "a" * 96 + "'",
             "x = '" + "é" * 95 + "'", "x = '" + "π" * 96 + "'", "# " + "a" * 98,
             "# " + "a" * 99, "x = '" + "é" * 94 + "'", "# " + "π" * 98]
    path = tmp_path / "m.py"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert [len(line) for line in lines] == [100, 101, 102, 101, 102, 100, 101, 100, 100]
    assert budget.measure(path)["long_lines"] == [2, 3, 4, 5, 7]


def test_every_file_check_covers_files_off_the_reading_path():
    """Guards owned(), which picks the files the every-file line check reads: tests, bench
    scripts, data/ and analysis/ are checked; only run folders and hidden or venv folders not."""
    for name in ("tests/test_budget.py", "bench/budget.py", "data/x.py", "analysis/x.py",
                 "configs/x.py", "support/x.py", "train.py"):
        assert owned(Path(name)), name
    for name in ("runs/a/b.py", ".venv/lib/x.py", "venv/lib/site-packages/x.py", "wandb/x.py"):
        assert not owned(Path(name)), name


def test_every_slow_entry_names_a_test():
    """tests/tiers.py's entries are starts of test ids: one that names no test (renamed, removed)
    would leave its test in CI's tier unnoticed, or mean nothing."""
    from tiers import SLOW

    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests"],
                       cwd=REPO, capture_output=True, text=True, check=False)
    ids = [line for line in p.stdout.splitlines() if "::" in line]
    assert len(ids) > 1000, p.stdout[-2000:]
    unmatched = [entry for entry in SLOW if not any(i.startswith(entry) for i in ids)]
    assert unmatched == []


@pytest.mark.fast
def test_every_hand_made_regression_still_applies():
    """tests/regressions.py's replacements each find their text exactly once: a refactor that
    rewrites the text leaves a regression that breaks nothing (the typed progress did, for
    generated_not_counted, until its text followed)."""
    from regressions import REGRESSIONS

    for name, (file, old, new, *_) in REGRESSIONS.items():
        assert (REPO / file).read_text().count(old) == 1, name
        assert new != old, name
