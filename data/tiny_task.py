"""The embedded task: seeded procedural arithmetic with worked solutions ending in \\boxed{...}.

Four problem kinds, chosen so the verifier has real work to do:
  add   `47+-18`     → `29`       integers, negatives
  mul   `-7*12`      → `-84`
  frac  `3/4+5/6`    → `19/12`    compare by value: `38/24` is also right
  lin   `3x+4=10`    → `2`        a linear equation in x; answers may be fractions (`5/2`)

Usage:
  python -m data.tiny_task --split test --n 500 --out tiny_test.jsonl   # MATH-500-shaped JSONL

The held-out split is fixed (its own seed, independent of the training seed) and no training problem
equals a held-out problem. Its knobs are `TinyTask`, the config section `data.tiny`
(`--data.tiny.max_int=50`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from fractions import Fraction
from math import lcm

from data.loaders import Problem, machine_memory

TEST_SEED = 1234  # the held-out split never changes with the training seed
TEST_SIZE = 500  # problems in the held-out split
DEFAULT_KINDS = "add:3,mul:2,frac:2,lin:2"


def _frac(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def make_problem(rng: random.Random, kind: str, max_int: int, max_den: int) -> dict:
    """One problem with its gold answer and a short worked solution (the SFT target)."""
    if kind == "add":
        a, b = rng.randint(-max_int, max_int), rng.randint(-max_int, max_int)
        op = rng.choice("+-")
        ans = a + b if op == "+" else a - b
        problem = f"{a}{op}{b}"
        work = ""
    elif kind == "mul":
        a, b = rng.randint(-9, 9), rng.randint(-max_int // 2, max_int // 2)
        ans = a * b
        problem = f"{a}*{b}"
        work = ""
    elif kind == "frac":
        n1, d1 = rng.randint(1, max_den), rng.randint(2, max_den)
        n2, d2 = rng.randint(1, max_den), rng.randint(2, max_den)
        op = rng.choice("+-")
        x, y = Fraction(n1, d1), Fraction(n2, d2)
        ans = x + y if op == "+" else x - y
        m = lcm(d1, d2)
        a, b = n1 * m // d1, n2 * m // d2
        raw = a + b if op == "+" else a - b
        problem = f"{n1}/{d1}{op}{n2}/{d2}"
        work = f"{a}/{m}{op}{b}/{m}={raw}/{m}"
        if Fraction(raw, m).denominator != m:  # show the reduction only when there is one
            work += f"={_frac(ans)}"
    elif kind == "lin":
        a = rng.choice([c for c in range(-5, 6) if c != 0])
        x = Fraction(rng.randint(-9, 9), rng.choice([1, 1, 1, 2]))
        b = rng.randint(-max_int // 2, max_int // 2)
        c = a * x + b
        if c.denominator != 1:  # keep the right-hand side an integer
            return make_problem(rng, kind, max_int, max_den)
        c = int(c)
        ax = "x" if a == 1 else "-x" if a == -1 else f"{a}x"
        sign = "+" if b >= 0 else "-"
        problem = f"{ax}{sign}{abs(b)}={c}"
        rhs = c - b
        work = f"{ax}={rhs}, x={rhs}/{a}"
    else:
        raise ValueError(f"unknown tiny task kind {kind!r}; expected add, mul, frac or lin")
    answer = _frac(Fraction(ans)) if kind != "lin" else _frac(x)
    solution = (work + " " if work else "") + f"\\boxed{{{answer}}}"  # worked steps, then the box
    return {"problem": problem, "answer": answer, "solution": solution, "kind": kind}


KINDS = ("add", "mul", "frac", "lin")
PROBLEM_BYTES = 800  # peak memory per problem, prompt ids included (measured: 625 before them)


def parse_kinds(kinds: str) -> tuple[list[str], list[float]]:
    """`kind:weight` pairs as (names, weights); ValueError for an unknown kind or a weight that is
    not a finite number ≥ 0, or when no weight is positive."""
    names, weights = [], []
    for part in kinds.split(","):
        name, _, w = part.partition(":")
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            weight = math.nan
        if name.strip() not in KINDS or not 0 <= weight < math.inf:
            raise ValueError(f"{part!r} is not kind:weight (a kind of {', '.join(KINDS)})")
        names.append(name.strip())
        weights.append(weight)
    if not sum(weights) > 0:
        raise ValueError("no kind has a positive weight")
    return names, weights


def distinct_problems(max_int: int, max_den: int, kinds: str) -> int:
    """An upper bound on the distinct problems the task can make (kinds of weight 0 excluded): a
    split asks for at most this many, or its search for new ones never ends."""
    b = 2 * (max_int // 2) + 1  # the operands drawn from [-max_int // 2, max_int // 2]
    count = {"add": 2 * (2 * max_int + 1) ** 2, "mul": 19 * b,
             "frac": 2 * (max_den * (max_den - 1)) ** 2,
             "lin": 10 * 38 * b}  # 10 coefficients, 38 values of x (halves included), b constants
    names, weights = parse_kinds(kinds)
    return sum(count[n] for n, w in zip(names, weights) if w > 0)


def make_split(split: str, n: int, seed: int = 0, *, max_int: int = 20, max_den: int = 6,
               kinds: str = DEFAULT_KINDS) -> list[dict]:
    """`n` distinct problems. `split="test"` uses the fixed TEST_SEED; `"train"` uses `seed` and
    skips test problems."""
    names, weights = parse_kinds(kinds)
    most = distinct_problems(max_int, max_den, kinds)
    if split == "train":
        most -= TEST_SIZE  # no training problem is a held-out one
    if n > most:
        raise ValueError(f"tiny task: {n:,} {split} problems asked, at most {most:,} distinct ones "
                         f"exist with max_int={max_int}, max_den={max_den}, kinds={kinds}")
    if n * PROBLEM_BYTES > machine_memory():
        gb = n * PROBLEM_BYTES / 2**30
        raise ValueError(f"tiny task: {n:,} problems take ~{gb:.0f} GB, more than this "
                         f"machine's {machine_memory() / 2**30:.0f} GB")
    rng = random.Random(TEST_SEED if split == "test" else 10_000 + seed)
    held_out = set()
    if split == "train":
        test = make_split("test", TEST_SIZE, max_int=max_int, max_den=max_den, kinds=kinds)
        held_out = {p["problem"] for p in test}
    seen, out = set(), []
    for _ in range(n * 50):
        p = make_problem(rng, rng.choices(names, weights)[0], max_int, max_den)
        if p["problem"] in seen or p["problem"] in held_out:
            continue
        seen.add(p["problem"])
        p["unique_id"] = f"tiny/{split}/{len(out)}"
        out.append(p)
        if len(out) == n:
            return out
    raise ValueError(f"tiny task: only {len(out)} distinct problems for n={n}; "
                     "raise max_int or max_den")


@dataclass
class TinyTask:
    """The config section `data.tiny`: read wherever data.train or data.eval is `tiny`."""

    train_size: int = 2000
    """Distinct training problems generated (prompts recur across epochs)."""
    max_int: int = 20
    """Difficulty: largest operand."""
    max_den: int = 6
    """Difficulty: largest fraction denominator."""
    kinds: str = DEFAULT_KINDS
    """The mix, as kind:weight pairs (add, mul, frac, lin)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        """{field: (ok, what it must be)}, as every config section's; never raises."""
        try:
            space = distinct_problems(self.max_int, self.max_den, self.kinds)
        except ValueError:
            space = 0  # kinds is not valid
        most = space - TEST_SIZE  # asking more, the search for new training problems never ends
        fits = machine_memory() // PROBLEM_BYTES
        size = (f"in [1, {min(most, fits):,}]: the tiny task makes at most {most:,} distinct "
                f"training problems with these data.tiny keys, and {fits:,} fit in this "
                f"machine's memory ({PROBLEM_BYTES} bytes each)")
        return {"max_int": (self.max_int >= 2, "≥ 2"),
                "max_den": (self.max_den >= 2, "≥ 2"),
                "kinds": (space > 0, "kind:weight pairs of add, mul, frac, lin"),
                "train_size": (1 <= self.train_size <= min(most, fits), size)}

    def load(self, split: str, n: int) -> list[Problem]:
        """`n` problems of `split` as `data.loaders.Problem` rows (the shape every dataset loads
        into); the training split is seed 0's, whatever the run's seed."""
        rows = make_split(split, n, max_int=self.max_int, max_den=self.max_den, kinds=self.kinds)
        return [Problem(p["problem"], p["answer"], p["unique_id"], "tiny") for p in rows]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    ap.add_argument("--split", choices=["train", "test"], default="test")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.out, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in make_split(a.split, a.n, a.seed))


if __name__ == "__main__":
    main()
