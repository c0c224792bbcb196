"""The core's line budgets and density (issue #40), measured on the files as they are.

Usage:
  python bench/budget.py            # print the figures; exit 0
  python bench/budget.py --check    # exit 1 if any target is missed
  python bench/budget.py --root DIR # another tree

Lines: non-blank, non-comment lines, docstrings counted (the rows a token other than a comment
covers), per subject against its budget: each file of the reading path and config.py, the reading
path together (train, grpo, rollout, replay), and each module of support/ (what a reader of GRPO may
skip), methods/ and analysis/; the README's lines, blank ones too. Density, over every subject file
and rewards.py and eval.py (shown without a budget): lines over 100 characters; conditional
expressions, comprehensions and tuples used as statements (`x.close() if x else None`, `[f(m) for m
in ms]`, `a(), b()`); `# noqa` outside rewards.py (the verifier's sandbox, where a broad except is
the contract); functions over 60 lines (from `def` to their last line: train.loop included); and the
mean characters per counted line (indentation included, trailing spaces not). Imports: no module
imports train.py, and grpo.py imports nothing from config.py.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import cli

READING_PATH = ["train.py", "grpo.py", "rollout.py", "replay.py"]
# grpo.py reads the update's log-prob pass (#48); metrics.py its metrics (518 -> 472 lines)
BUDGETS = {"train.py": 350, "grpo.py": 480, "rollout.py": 260, "replay.py": 500, "config.py": 330}
READING_BUDGET = 1650
PACKAGES = ["support", "methods", "analysis"]  # scale and I/O; the methods compared; the analysis
PACKAGE_BUDGET = 300  # each module of each package
README_BUDGET = 250
OTHERS = ["batch.py", "metrics.py", "rewards.py", "eval.py"]  # shown without a budget
MAX_CHARS = 100
MAX_FUNCTION = 60
STATEMENT_KINDS = (ast.IfExp, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Tuple)
NOQA = re.compile(r"#\s*noqa", re.IGNORECASE)
FINDINGS = [("long_lines", f"lines over {MAX_CHARS} characters"),
            ("statements", "conditional expressions, comprehensions, tuples as statements"),
            ("noqa", "# noqa outside rewards.py"),
            ("functions", f"functions over {MAX_FUNCTION} lines"),
            ("imports", "imports of train.py (any module) or of config.py (grpo.py)")]
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
        tokenize.ENCODING, tokenize.ENDMARKER}


def code_lines(source: str) -> list[int]:
    """Numbers of the non-blank lines a token other than a comment covers (docstrings included)."""
    rows = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in SKIP:
            rows.update(range(tok.start[0], tok.end[0] + 1))
    lines = source.splitlines()
    return sorted(n for n in rows if n <= len(lines) and lines[n - 1].strip())


def statement_expressions(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, kind) of each expression statement that is a conditional, comprehension or tuple."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, STATEMENT_KINDS):
            found.append((node.lineno, type(node.value).__name__))
    return sorted(found)


def long_functions(tree: ast.AST) -> list[tuple[int, str, int]]:
    """(line, name, length) of every function longer than MAX_FUNCTION lines, `def` to last line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION:
                found.append((node.lineno, node.name, length))
    return sorted(found)


def forbidden_imports(tree: ast.AST, name: str) -> list[tuple[int, str]]:
    """(line, module) of each import #28 rules out: train.py from any core module (the loop is the
    top; nothing builds on it), config.py from grpo.py (tensors in, tensors out)."""
    banned = {"train"}
    if name == "grpo.py":
        banned.add("config")
    found = []
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module]
        for module in modules:
            if module.split(".")[0] in banned:
                found.append((node.lineno, module))
    return found


def measure(path: Path) -> dict:
    """One file's figures."""
    source = path.read_text()
    lines = source.splitlines()
    counted = code_lines(source)
    tree = ast.parse(source)
    noqa = []
    if path.name != "rewards.py":
        noqa = [(n,) for n, line in enumerate(lines, 1) if NOQA.search(line)]
    chars = sum(len(lines[n - 1].rstrip()) for n in counted)
    return {"lines": len(counted), "chars": chars,
            "long_lines": [n for n, line in enumerate(lines, 1) if len(line) > MAX_CHARS],
            "statements": statement_expressions(tree), "noqa": noqa,
            "functions": long_functions(tree), "imports": forbidden_imports(tree, path.name)}


def subjects(root: Path) -> list[tuple[str, list[str], int | None]]:
    """(name, files, budget) per subject: each reading-path file and config.py, the reading path
    together, each module of support/, and the other modules without a budget."""
    found = [(name, [name], budget) for name, budget in BUDGETS.items()]
    found.append(("reading path (" + " ".join(READING_PATH) + ")", READING_PATH, READING_BUDGET))
    for package in PACKAGES:
        for f in sorted((root / package).glob("*.py")):
            name = f"{package}/{f.name}"
            found.append((name, [name], PACKAGE_BUDGET))
    for name in OTHERS:
        found.append((name, [name], None))
    return found


def report(root: Path) -> int:
    """Prints every figure; returns the number of targets missed."""
    files = {}
    for _, names, _ in subjects(root):
        for name in names:
            if (root / name).is_file():
                files[name] = measure(root / name)
    missed = 0
    print(f"{'subject':<60} {'lines':>6} {'budget':>7}")
    for title, names, budget in subjects(root):
        missing = [n for n in names if n not in files]
        lines = sum(files[n]["lines"] for n in names if n in files)
        if budget is None:
            print(f"{title:<60} {lines:>6} {'-':>7}  (no budget)")
            continue
        verdict = "ok" if lines <= budget and not missing else "MISSED"
        if missing:
            verdict += " (no " + ", ".join(missing) + ")"
        missed += verdict != "ok"
        print(f"{title:<60} {lines:>6} {budget:>7}  {verdict}")
    readme = root / "README.md"
    if readme.is_file():  # every line, blank ones too: what a newcomer scrolls through
        lines = len(readme.read_text().splitlines())
        missed += lines > README_BUDGET
        verdict = "ok" if lines <= README_BUDGET else "MISSED"
        print(f"{'README.md (every line)':<60} {lines:>6} {README_BUDGET:>7}  {verdict}")
    missed += density(files)
    print(f"\n{missed} target(s) missed")
    return missed


def density(files: dict[str, dict]) -> int:
    """Prints the density table and each finding; returns the number of density targets missed."""
    print(f"\n{'file':<16} {'lines':>6} {'chars/line':>10} {'>100 ch':>8} {'stmt-expr':>9} "
          f"{'noqa':>5} {'fn>60':>6}")
    for name, m in files.items():
        print(f"{name:<16} {m['lines']:>6} {m['chars'] / max(1, m['lines']):>10.1f} "
              f"{len(m['long_lines']):>8} {len(m['statements']):>9} {len(m['noqa']):>5} "
              f"{len(m['functions']):>6}")
    lines = sum(m["lines"] for m in files.values())
    chars = sum(m["chars"] for m in files.values())
    print(f"{'all':<16} {lines:>6} {chars / max(1, lines):>10.1f}")
    missed = 0
    for key, title in FINDINGS:
        found = [(name, item) for name, m in files.items() for item in m[key]]
        print(f"\n{title}: {len(found)}")
        missed += bool(found)
        if key != "long_lines":
            for name, item in found:
                print(f"  {name}:" + ":".join(map(str, item)))
    return missed


def main(argv: list[str] | None = None) -> int:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--root", default=str(ROOT), help="the tree to measure (default: this repo)")
    ap.add_argument("--check", action="store_true", help="exit 1 if any target is missed")
    args = ap.parse_args(argv)
    if not Path(args.root).is_dir():
        ap.error(f"--root {args.root}: not a folder")
    missed = report(Path(args.root))
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
