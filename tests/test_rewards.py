"""rewards.py: hand examples, labelled cases per kind of answer form, extraction, the reward and its
metrics, config checks, agreement with math-verify's own test cases, MATH-500 / GSM8K
gold-vs-solution checks, cross-problem false positives, hostile inputs (bounded time, nothing
executed), the worker timeout (kill, replace, reap), the per-batch budget and a cheap import. Shared
data: $SHARED_DATA_DIR or ../shared/data; the tests that need it are skipped with a message when it
is missing."""

import builtins
import json
import os
import re
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest

import rewards as R

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
DATA = Path(os.environ.get("SHARED_DATA_DIR",
                           Path(__file__).resolve().parents[2] / "shared" / "data"))


def read_jsonl(relative):
    path = DATA / relative
    if not path.exists():
        pytest.skip(f"shared data file {path} not found (set SHARED_DATA_DIR)")
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------ hand examples
B = "\\boxed{%s}"
HAND = [  # (completion, gold, equal?)
    (B % "38/24", "19/12", True), (B % "\\frac{38}{24}", "19/12", True),
    (B % "\\dfrac{19}{12}", "\\frac{19}{12}", True),
    (B % "-12", "-12", True), (B % "12", "-12", False), (B % "- 12", "-12", True),
    ("so $x = 2$, hence \\boxed{x = 2}", "2", True), (B % "x=2", "x = 2", True),
    (B % "x = 3", "2", False),
    (B % "25", "025", True), (B % "025", "25", True),  # AIME gold is zero-padded
    (B % "27", "27.0", True), (B % "27.5", "27.0", False),  # AMC gold is a float
    # GSM8K
    ("3 * 411 = 1,233 and one more.\n#### 1,234", "1234", True),
    ("The answer is 1234.", "1,234", True),
    (B % "[0, 1)", "[0,1)", True), (B % "(0,1]", "[0,1)", False),
    (B % "(-\\infty, 2) \\cup (3, \\infty)", "(-\\infty,2)\\cup(3,\\infty)", True),
    (B % "\\{3, 1, 2\\}", "\\{1,2,3\\}", True), (B % "3, 5, 7", "7, 3, 5", True),
    (B % "1, 2", "1, 2, 3", False),
    (B % "(1, 2)", "(1,2)", True), (B % "(2, 1)", "(1,2)", False),
    (B % "(1, 2, 3)", "(1,2)", False),
    (B % "2\\pi", "2 \\pi", True), (B % "\\pi \\cdot 2", "2\\pi", True),
    (B % "6.28", "2\\pi", False),
    (B % "3.14159265359", "\\pi", True), (B % "3.1416", "\\pi", False),
    (B % "\\sqrt{8}", "2\\sqrt{2}", True), (B % "\\sqrt[3]{27}", "3", True),
    (B % "\\sqrt2", "\\sqrt{2}", True),
    (B % "\\frac{1}{\\sqrt{3}}", "\\frac{\\sqrt{3}}{3}", True), (B % "\\sqrt{3}", "3", False),
    (B % "1.414214", "\\sqrt2", True),
    (B % "90^\\circ", "90", True), (B % "50\\%", "50", True), (B % "18.9", "\\$18.90", True),
    (B % "5 \\text{ cm}^2", "5", True),
    (B % "1 \\pm \\sqrt{2}", "1+\\sqrt{2}, 1-\\sqrt{2}", True),
    (B % "1 + \\sqrt{2}", "1 \\pm \\sqrt{2}", False),
    (B % "1\\frac{4}{5}", "\\frac{9}{5}", True), (B % "1.5 \\times 10^{3}", "1500", True),
    (B % "y = 2x + 3", "y=2x+3", True), (B % "2x - y + 3 = 0", "y = 2x + 3", True),
    (B % "y = 2x - 3", "y = 2x+3", False),
    (B % "x \\geq 5", "5 \\le x", True), (B % "x > 5", "(5, \\infty)", True),
    (B % "x < 5", "(5, \\infty)", False),
    (B % "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    (B % "\\begin{bmatrix} 1 \\\\ 3 \\end{bmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", False),
    (B % "\\text{(C)}", "C", True), (B % "\\textbf{Evelyn}", "\\text{Evelyn}", True),
    (B % "East", "\\text{east}", True),
    (B % "\\text{neve}", "\\text{even}", False),  # words are names, not products of letters
    (B % "1000001", "1000000", False), (B % "0.3333333", "1/3", True), (B % "0.33", "1/3", False),
    (B % "-5i + 6", "6-5i", True), (B % "\\frac{x+2}{7}", "\\frac{x}{7}+\\frac{2}{7}", True),
    (B % "(a+5)(b+2)", "ab+2a+5b+10", True), (B % "(a+5)(b+3)", "ab+2a+5b+10", False),
    (B % "\\sin^2 x + \\cos^2 x", "1", True), (B % "\\log_2 8", "3", True), (B % "5!", "120", True),
    (B % "\\binom{5}{2}", "10", True), (B % "\\lfloor 3.7 \\rfloor", "3", True),
    (B % "\\lceil 3.2 \\rceil", "3", False),
    (B % "52_8", "52_8", True), (B % "42", "52_8", False),
    (B % "-\\infty", "\\infty", False),
    ("I think it is 5", "5", False),  # no boxed answer: no answer by default
]


@pytest.mark.fast
@pytest.mark.parametrize("completion,gold,expected", HAND)
def test_hand_examples(completion, gold, expected):
    assert R.verify(completion, gold) is expected


# ------------------------------------------------------------------------------------- answer forms
# Our own labelled (gold, prediction, equal?) cases for each form of answer graders meet,
# near-misses included; each is checked as the math-verify cases are (last-number fallback on,
# rel_tol 1e-6). Where math-verify 0.9.0 answers differently, the case says why we think it is wrong
# ("mv: ..."); every other case agrees with it.
KINDS = {
    "labelled value or equation": [
        ("$x = 5$", "$5$", True), ("$5$", "$x=5$", True), ("$f(x) = 2x+1$", "$2x+1$", True),
        ("$2x+1$", "$f(x) = 2x + 1$", True), ("$AB:BC = 2:3$", "$2:3$", True),
        ("$\\frac{BD}{DC} = \\frac{5}{7}$", "$5/7$", True),
        ("$\\frac{BD}{DC} = \\frac{5}{7}$", "$7/5$", False),
        ("$m\\angle A = 30^\\circ$", "$30$", True),
        ("$\\sin\\theta = \\frac{1}{2}$", "$\\frac12$", True), ("$m+n = 17$", "$17$", True),
        ("$v = 5 \\text{ m/s}$", "$5$", True),
        ("$k = 4$", "$k = 5$", False), ("$x = 5$", "$y = 5$", False),
        ("$7 = 11a + c$", "$11a+c$", False),
        ("$2x + z = 1$", "$1$", False), ("$x^2 + y^2 = 25$", "$25$", False),
        ("$f(x) = 3x - 2$", "$f(x) = 3x + 2$", False),
        ("$a_n = 2n+1$", "$2n-1$", False),
        ("$h(t) = -16t^2 + 64t$", "$-16t^2+64$", False),  # mv: equal, though the polynomials differ
    ],
    "inequality or interval": [
        ("$x > 3$", "$3 < x$", True), ("$-x < -3$", "$x > 3$", True),
        ("$x \\le 2$", "$-2 \\le -x$", True),
        ("$x \\geq 2$", "$-x \\geq -2$", False), ("$x \\le 2$", "$x < 2$", False),
        ("$x > 3$", "$(3, \\infty)$", True),
        ("$x \\ge 3$", "$(3, \\infty)$", False), ("$-1 \\le x < 2$", "$[-1, 2)$", True),
        ("$-1 < x < 2$", "$[-1, 2]$", False),
        ("$t \\geq 0$", "$t\\geqslant0$", True),
        ("$x > \\frac{1}{2}$", "$x \\geq \\frac12$", False), ("$x > 3$", "$y > 3$", False),
        ("$x \\neq 1$", "$(-\\infty,1)\\cup(1,\\infty)$", True),
        ("$x \\neq 1$", "$(-\\infty,1)\\cup(2,\\infty)$", False),
        ("$\\mathbb{R}$", "$(-\\infty, \\infty)$", True),
        # mv: unequal, it compares the two relations of a chain pairwise
        ("$2 < x < 5$", "$5 > x > 2$", True),
        ("$2 < x < 5$", "$-5 < -x < -2$", True),  # mv: unequal, as above
        # mv: unequal unless its set/relation option is on (see KNOWN_MISSES)
        ("$[2, 7]$", "$2 \\le x \\le 7$", True),
        # mv: unequal, it reads "or" as a set of relations
        ("$x < -2$ or $x > 2$", "$(-\\infty,-2)\\cup(2,\\infty)$", True),
    ],
    "several answers": [
        ("$2, 3$", "$\\boxed{2}$ and $\\boxed{3}$", True),
        ("$3, -5$", "$x = 3 \\text{ or } x = -5$", True),
        ("$2, 3$", "$2$", False), ("$2$", "$\\boxed{2, 3}$", False),
        ("$(1, 2)$", "$x = 1, y = 2$", True),
        ("$(1, 2)$", "$x=2, y=1$", False), ("$(1, 1), (-1, -1)$", "$x=1,y=1; x=-1,y=-1$", True),
        ("$(1, 1), (-1, -1)$", "$x=1,y=1; x=-1,y=1$", False),
        ("$(1, 2), (3, 4)$", "$(x, y) = (1, 2), (3, 4)$", True),
        ("$\\pm 3$", "$\\{-3, 3\\}$", True), ("$\\{-3, 3\\}$", "$\\pm 3$", True),
        ("$\\pm 2$", "$2$", False),
        ("$1, 2, 3$", "\\boxed{1}, \\boxed{2}", False),
        ("$(2, 1), (1, 2)$", "$(1,2) \\text{ or } (2,1)$", True),
        # mv: unequal, it flattens the four equations
        ("$(1, 2), (3, 4)$", "$x=1, y=2$ and $x=3, y=4$", True),
        # mv: unequal; the same solution, variables taken in name order
        ("$(2, -1)$", "$y = -1, x = 2$", True),
    ],
    "ratio or chain": [
        ("$2:3$", "$\\frac{2}{3}$", True), ("$2:3$", "$4:6$", True), ("$2:3$", "$3:2$", False),
        ("$3:4$", "$0.75$", True),
        ("$1:\\sqrt{3}$", "$\\frac{\\sqrt3}{3}$", True), ("$x = 2+3 = 5$", "$5$", True),
        ("$5$", "$x = 2 + 3 = 5$", True),
        ("$5$", "$x = 2+3 = 6$", False), ("$a = b = 3$", "$3$", True),
        ("$12$", "$3 \\cdot 4 = 12$", True),
        ("$12$", "$3\\cdot 4 = 13$", False), ("$A = \\pi r^2 = 25\\pi$", "$25\\pi$", True),
        ("$2^{10} = 1024$", "$1024$", False),
        ("$x = y = 2$", "$3$", False),
        # mv: unequal, it looks for the name only in the first member
        ("$2 + 3 = n = 5$", "$5$", True),
    ],
    "matrix": [
        ("$\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}$",
         "$\\left[\\begin{array}{cc}1&2\\\\3&4\\end{array}\\right]$", True),
        ("$\\left[\\begin{array}{cc}1&2\\\\3&4\\end{array}\\right]$",
         "$\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}$", True),
        ("$\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}$",
         "$\\left[\\begin{array}{cc}1&2\\\\3&5\\end{array}\\right]$", False),
        ("$\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}$",
         "$\\left[\\begin{array}{cc}1&3\\\\2&4\\end{array}\\right]$", False),
        ("$\\begin{pmatrix}3\\\\-2\\end{pmatrix}$",
         "$\\left[ \\begin{array}{c} 3 \\\\ -2 \\end{array} \\right]$", True),
        ("$\\begin{pmatrix}1\\\\2\\end{pmatrix}$",
         "$\\left[\\begin{array}{cc}1&2\\end{array}\\right]$", False),
        ("$\\begin{pmatrix}\\frac12\\\\-1\\end{pmatrix}$",
         "$\\left(\\begin{array}{c}0.5\\\\-1\\end{array}\\right)$", True),
        ("$\\begin{bmatrix}1&0\\\\0&1\\end{bmatrix}$",
         "$\\left[\\begin{array}{rr}1&0\\\\0&1\\end{array}\\right]$", True),
        ("$\\begin{pmatrix}1&2&3\\end{pmatrix}$",
         "$\\left[ \\begin{array}{ccc} 1 & 2 & 3 \\end{array} \\right]$", True),
        ("$-2$", "$\\begin{vmatrix}1&2\\\\3&4\\end{vmatrix}$", True),  # a vmatrix is a determinant
        ("$\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}$",
         "$\\begin{vmatrix}1&2\\\\3&4\\end{vmatrix}$", False),
        ("$\\begin{pmatrix}a&b\\\\c&d\\end{pmatrix}$",
         "$\\left[\\begin{array}{ll}a&b\\\\c&d\\end{array}\\right]$",
         True),  # mv: unequal, it cannot parse either matrix of letters
    ],
    "mixed number": [
        ("$\\frac{7}{3}$", "$2\\frac{1}{3}$", True), ("$\\frac{7}{3}$", "$2 \\frac{1}{3}$", True),
        ("$\\frac73$", "$2\\ \\frac13$", True),
        ("$\\frac{11}{4}$", "\\boxed{2\n\\frac{3}{4}}", True),
        ("$\\frac{7}{3}$", "$2\\cdot\\frac{1}{3}$", False),
        ("$\\frac{2}{3}$", "$2\\frac{1}{3}$", False), ("$2^{\\frac13}$", "$2\\frac13$", False),
        ("$-1\\frac{1}{2}$", "$-\\frac{3}{2}$", True), ("$5\\frac{3}{4}$", "$5.74$", False),
        ("$2\\frac{1}{2}$", "$2\\frac12$ hours", True),
        ("$3\\frac{1}{2}\\%$", "$3\\frac12 \\%$", True),
        # mv: unequal, it reads 12\frac{1}{2}\% as 12
        ("$12\\frac{1}{2}\\%$", "$12\\frac12$ percent", True),
        ("$7/3$", "$2 1/3$", True),  # mv: unequal, it reads "2 1/3" as 1
    ],
    "decimal comma, dollars, units": [
        ("$3.5$", "3,5", True), ("$0.125$", "$0,125$", True), ("$1234$", "$1,234$", True),
        ("$1.234$", "$1,234$", False),
        ("$3.14$", "$3,15$", False), ("$75$", "$0,075$", False), ("$5$", "$\\$5$", True),
        ("$12.50$", "The cost is $\\$12.50$.", True),
        ("$3.25$", "$\\$3.52$", False), ("$5$", "$5 \\text{ cm}$", True),
        ("$4\\text{ m}$", "$4$", True),
        ("$72$", "$72 \\text{ km/h}$", True), ("$5$", "$6 \\text{ cm}$", False),
        ("$5$", "$5cm$", True),
        # letters after a number are a unit only when they are one
        ("$2$", "$2xy$", False), ("$2$", "$a^2+b^2-2abc$", False),
        ("$5$", "$\\text{approximately } 5$", False),  # words before a number are not a unit
        # mv: unequal inside $..$, where it reads the comma as a list; a list reading stays
        ("$12.75$", "$12,75$", True),
    ],
    "Answer: line (DAPO)": [
        ("4", "We compute 2+2.\nAnswer: 4", True), ("4", "Answer: $4$", True),
        ("4", "**Answer:** 4", True), ("4", "Answer: 5", False),
        ("\\frac{3}{2}", "Answer: 3/2", True), ("\\frac{3}{2}", "Answer: 2/3", False),
        ("-7", "Answer: -7", True),
        ("x^2+1", "Answer: $x^2 - 1$", False), ("2", "The answer is 2.\nAnswer: 3", False),
        ("5", "Answer: 6 (not 5)", False),
        ("(1,2)", "Answer: (1, 2)", True),  # mv: unequal, its plain-text reading keeps only the 2
        ("x^2+1", "Answer: $x^2 + 1$", True),  # mv: unequal, as above
    ],
}
KIND_CASES = [(kind, *case) for kind, cases in KINDS.items() for case in cases]


@pytest.mark.fast
@pytest.mark.parametrize("kind,gold,pred,expected", KIND_CASES)
def test_answer_forms(kind, gold, pred, expected):
    assert R.verify(pred, gold, rel_tol=1e-6, last_number_fallback=True) is expected


@pytest.mark.fast
def test_extraction():
    assert R.extract_answer("first \\boxed{1}, then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert R.extract_answer("\\fbox{7}") == "7"
    # one list answer
    assert R.extract_answer("so \\boxed{1}, \\boxed{2} and \\boxed{3}") == "1, 2, 3"
    assert R.extract_answer("\\boxed{3}. Then \\boxed{4") == "3"  # an unclosed box is ignored
    assert R.extract_answer(
        "Final Answer: The final answer is $10,455$. I hope it is correct.") == "10,455"
    assert R.extract_answer("\\boxed{5}. Wait, the answer is 7.") == "7"  # the latest answer wins
    assert R.extract_answer("Janet sells 9 eggs.\n#### 18") == "18"
    assert R.extract_answer("I think it is 5 or 6") is None
    assert R.extract_answer("I think it is 5 or 6", last_number_fallback=True) == "6"
    assert R.extract_answer("so $x = 3$ in the end", last_number_fallback=True) == "x = 3"
    assert R.extract_answer("\\boxed{" + "9" * 10_000 + "}") is None  # too long to be an answer
    # the DAPO format
    assert R.extract_answer("Let me think.\n\nAnswer: $\\frac{1}{2}$") == "\\frac{1}{2}"
    assert R.extract_answer("Answering this needs care: 3 steps. So 5") is None
    assert R.extract_answer("Answer: 12\nWait, \\boxed{13}") == "13"  # the latest answer wins
    # units go in normalisation
    assert R.extract_answer("Answer: the area is $6$ square units.") == "$6$ square units"
    assert R.extract_answer(
        "Final Answer: The volume of $ABCH$ is 120. I hope it is correct.") == "120"


@pytest.mark.fast
def test_reward_values_and_metrics():
    cfg = R.RewardConfig(correct=1.0, wrong=-0.5, no_answer=-1.0, format_bonus=0.1)
    rewards, _, _, _ = R.score_batch(["\\boxed{4}", "\\boxed{5}", "The answer is 4.", "no idea"],
                                  ["4"] * 4, cfg)
    assert rewards == pytest.approx([1.1, -0.4, 1.0, -1.0])  # a box earns the bonus even when wrong
    rewards, correct, metrics, _ = R.score_batch(
        ["\\boxed{4}", "\\boxed{x+1}", "nothing", "\\boxed{2}"],
        ["4", "1+x", "3", "3"], R.RewardConfig())
    assert rewards == [1.0, 1.0, 0.0, 0.0] and correct == [True, True, False, False]
    assert (metrics["reward/no_answer_frac"] == 0.25
            and metrics["reward/timeouts"] == metrics["reward/over_budget"] == 0)
    # only x+1 needed sympy; plain numbers stayed in-process
    assert metrics["reward/worker_frac"] == 0.25
    assert R.score_batch([], [], R.RewardConfig())[:2] == ([], [])


@pytest.mark.fast
def test_config_check_names_the_key():
    assert all(ok for ok, _ in R.RewardConfig().check().values())
    bad = R.RewardConfig(timeout=0, batch_budget=float("inf"), workers=0, rel_tol=-1.0,
                         correct=float("nan"), wrong="x")
    failed = {k: rule for k, (ok, rule) in bad.check().items() if not ok}
    assert failed["timeout"] == "> 0 and finite"
    assert sorted(failed) == ["batch_budget", "correct", "rel_tol", "timeout", "workers", "wrong"]
    assert [ok for ok, _ in R.RewardConfig(timeout=None, workers=2.5,
                                           rel_tol=[1]).check().values()].count(False) == 3


# -------------------------------------------------------------------------------------- shared data
# math-verify's own test cases that we answer differently, and why.
KNOWN_MISSES = {
    "mv-0188": "'x \\in [-2,7]' vs '-2 \\\\le x \\\\le 7': math-verify says unequal unless its "
               "set/relation option is on (the same pair with it on, mv-0185/0187, expects "
               "equal); we always compare relations with intervals",
    "mv-0265": "'f(x)' vs 'f(y)': the same pair is labelled unequal in mv-0264 under the same "
               "settings; we say unequal",
}


@pytest.mark.fast
def test_agreement_with_math_verify_cases():
    cases = read_jsonl("verifier/mathverify_cases.jsonl")
    misses = [c["id"] for c in cases
              if R.verify(c["pred"], c["gold"], rel_tol=10.0 ** -c["float_rounding"],
                          last_number_fallback=True)
              != c["expected"]]
    agreement = 1 - len(misses) / len(cases)
    print(f"math-verify cases: {len(cases) - len(misses)}/{len(cases)} = {agreement:.1%}; "
          f"misses {misses}")
    assert agreement >= 0.97
    assert set(misses) <= set(KNOWN_MISSES), f"new disagreements: {set(misses) - set(KNOWN_MISSES)}"


@pytest.mark.fast
def test_math500_gold_matches_its_solution():
    rows = read_jsonl("benchmarks/math500_test.jsonl")
    _, correct, metrics, _ = R.score_batch([r["solution"] for r in rows],
                                           [r["answer"] for r in rows], R.RewardConfig())
    assert ([r["answer"] for r, ok in zip(rows, correct) if not ok] == []
            and metrics["reward/timeouts"] == 0)


@pytest.mark.fast
def test_gsm8k_answer_matches_its_solution():
    rows = read_jsonl("benchmarks/gsm8k_test.jsonl")
    golds = [r["answer"].split("####")[-1].strip() for r in rows]
    _, correct, _, _ = R.score_batch([r["answer"] for r in rows], golds, R.RewardConfig())
    assert sum(correct) == len(rows) == 1319


TRULY_EQUAL = {(281, 287)}  # '36^\circ' and '36': degrees are dropped, so these are the same answer


def test_no_false_positives_across_math500_problems():
    """Gold answer i against the solution of problem i+k (k = 1..10, 5,000 pairs): every pair judged
    equal must have the same answer, up to spaces and an 'x =' prefix, or be listed in
    TRULY_EQUAL."""
    rows = read_jsonl("benchmarks/math500_test.jsonl")
    pairs = [(i, (i + k) % len(rows)) for k in range(1, 11) for i in range(len(rows))]
    _, correct, metrics, _ = R.score_batch([rows[j]["solution"] for _, j in pairs],
                                        [rows[i]["answer"] for i, _ in pairs],
                                        R.RewardConfig())
    def same_answer(i, j):
        return (re.sub(r"\s+|^[a-z]=", "", rows[i]["answer"])
                == re.sub(r"\s+|^[a-z]=", "", rows[j]["answer"]))
    wrong = [(i, j, rows[i]["answer"], rows[j]["answer"]) for (i, j), ok in zip(pairs, correct)
             if ok and not same_answer(i, j) and (i, j) not in TRULY_EQUAL]
    print(f"cross-problem pairs judged equal: {sum(correct)} of {len(pairs)}, "
          f"all truly equal: {not wrong}")
    assert wrong == [] and metrics["reward/timeouts"] == 0


# ------------------------------------------------------------------------------------------- safety
@pytest.mark.fast
def test_hostile_examples_are_bounded_and_never_raise():
    rows = read_jsonl("verifier/hostile_examples.jsonl")
    R.verify("\\boxed{x+1}", "1+x")  # start the pool outside the timings
    limit = 1.0
    for row in rows:
        t0 = time.perf_counter()
        for fallback in (False, True):
            assert R.verify(row["pred"], row["gold"], timeout=limit,
                            last_number_fallback=fallback) is False
        elapsed = (time.perf_counter() - t0) / 2
        print(f"{row['id']}: {elapsed * 1000:.1f} ms")
        assert elapsed < 2 * limit, row["id"]
    for text in (None, 12, "\\boxed{}", "\\boxed{\\frac{1}{0}}", "\\boxed{" * 5000, "$" * 5000,
                 "\\[" * 5000):
        assert R.verify(text, "0", last_number_fallback=True) in (True, False)


@pytest.mark.fast
def test_model_text_is_never_executed(tmp_path, monkeypatch):
    target = tmp_path / "pwned"
    payloads = [f"__import__('os').system('touch {target}')", f"eval(\"open('{target}', 'w')\")",
                f"exec('open(\\'{target}\\', \\'w\\')')", f"lambda: open('{target}', 'w')",
                "().__class__.__bases__[0].__subclasses__()", "zq_marker + 1"]
    completions = [f"\\boxed{{{p}}}" for p in payloads] + [f"The answer is {p}" for p in payloads]
    # The gold is a number no payload or temp path contains: the last-number fallback reads digits
    # out of the text (e.g. "pytest-0"), which is extraction, not execution.
    assert not any(R.verify(c, "-271828", last_number_fallback=True) for c in completions)
    # In-process too, with eval/exec watched: sympy may evaluate its own source strings on lazy
    # imports, but never text from the answer.
    seen = []
    for name in ("eval", "exec"):
        real = getattr(builtins, name)

        def watched(src, *args, _real=real, **kwargs):
            seen.append(src if isinstance(src, str) else "")
            return _real(src, *args, **kwargs)
        monkeypatch.setattr(builtins, name, watched)
    for p in payloads:
        assert R._equivalent(R._readings(p), ("0",), 1e-6) is False
        assert R._equivalent(R._readings(p), (R._normalize(p) + "+1",), 1e-6) is False
    assert not target.exists()
    markers = ("pwned", "zq_marker", "__import__", "__subclasses__", "open(")
    assert not [s for s in seen if any(m in s for m in markers)]


# Too many symbols for values at sample points, so sympy expands (a+...+w)^12 in simplify: minutes
# of work.
SLOW = "\\boxed{\\frac{(%s)^{12}-1}{(%s)-1}}" % (("+".join("abcdfghjklmnopqrstuvw"),) * 2)


def test_worker_timeout_kills_and_replaces():
    R.verify("\\boxed{x+1}", "1+x")
    before = [p.pid for p in R._pool.procs]
    slow = SLOW
    t0 = time.perf_counter()
    _, correct, metrics, _ = R.score_batch([slow, "\\boxed{2x}", slow], ["1", "x+x", "1"],
                                        R.RewardConfig(timeout=0.5))
    elapsed = time.perf_counter() - t0
    assert correct == [False, True, False] and metrics["reward/timeouts"] == 2 and elapsed < 2.0
    after = [p.pid for p in R._pool.procs]
    assert len(after) == len(before) and set(after) != set(before)
    # killed and reaped: gone from the process table, not a zombie
    for pid in set(before) - set(after):
        assert not Path(f"/proc/{pid}").exists() or sys.platform != "linux"
    assert R.verify("\\boxed{\\sqrt{2}^2}", "2")  # the replacements work


def test_batch_budget_bounds_a_batch_of_slow_answers():
    R.verify("\\boxed{x+1}", "1+x")  # a warm pool
    cfg = R.RewardConfig(timeout=1.0, batch_budget=1.5)
    t0 = time.perf_counter()
    _, correct, metrics, _ = R.score_batch([SLOW] * 8, ["1"] * 8, cfg)
    elapsed = time.perf_counter() - t0
    assert not any(correct) and metrics["reward/over_budget"] > 0
    # every slow answer is accounted for
    assert metrics["reward/timeouts"] + metrics["reward/over_budget"] == 8
    assert elapsed < cfg.batch_budget + 2 * cfg.timeout
    assert R.verify("\\boxed{\\sqrt{2}^2}", "2")  # the pool recovers


def test_import_is_cheap_and_pool_closes_at_exit():
    code = ("import sys, rewards; assert 'sympy' not in sys.modules and rewards._pool is None; "
            "rewards.verify('\\\\boxed{x+1}', '1+x'); print(*[p.pid for p in rewards._pool.procs])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == R.RewardConfig().workers
    time.sleep(0.2)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()] or sys.platform != "linux"


@pytest.mark.fast
def test_decimal_over_integer_never_raises():
    # Found by the tiny model: "\boxed{.6/12}" matched the plain-number path, where
    # Fraction(".6/12") raised and took score_batch down with it.
    assert (R.verify("\\boxed{.6/12}", "0.05") and R.verify("\\boxed{1.5/3}", "1/2")
            and not R.verify("\\boxed{.6/12}", "1/2"))
    assert R.score_batch(["\\boxed{.6/12\\%}", "\\boxed{-.5/0.25}"], ["1", "-2"],
                         R.RewardConfig())[1] == [False, True]


# (answer, other, rel_tol, equal?): each checked both ways round, as prediction and as gold
PLAIN_DECIMALS = [
    ("0.5", "1/2", 1e-6, True), ("-0.5", "-1/2", 1e-6, True), ("0.5", "1/3", 1e-6, False),
    ("0.333", "1/3", 2e-3, True), ("0.333", "1/3", 1e-6, False), ("0.3333333", "1/3", 1e-6, True),
    ("2.50", "2.5", 1e-6, True), ("2.500", "5/2", 1e-6, True), ("2.50", "2.6", 1e-6, False),
    ("3.0", "3", 1e-6, True), ("3.0000001", "3", 1e-6, True), ("3.01", "3", 1e-6, False),
    ("3.01", "3", 1e-2, True), (".5", "1/2", 1e-6, True), ("1000000.5", "1000001", 1e-6, True),
    ("0.1", "0", 1e-6, False),
    ("1.5", "1", 0.4, True),  # within 0.4 of the larger (1.5), not of the smaller
    ("1.0", "2", 0.5, True), ("1.0", "2.01", 0.5, False),  # the bound itself is within
]


@pytest.mark.fast
@pytest.mark.parametrize("answer,other,tol,expected", PLAIN_DECIMALS)
def test_plain_decimal_tolerance_both_ways(answer, other, tol, expected):
    """Guards the plain-number fast path's tolerance (rewards._quick_equal): a decimal is equal to
    a fraction or an integer within rel_tol of the larger, trailing zeros change nothing, and it
    holds whichever side (prediction or gold) holds the decimal."""
    assert R.verify(B % answer, other, rel_tol=tol) is expected
    assert R.verify(B % other, answer, rel_tol=tol) is expected
    assert R._quick_equal(answer, other, tol) is expected
    assert R._quick_equal(other, answer, tol) is expected


def near_bound(value: str, rel_tol: str, factor: str, of: str) -> str:
    """The decimal `factor` · `rel_tol` of |value| away from `value`: towards zero when `value` is
    to be the larger in magnitude (of="larger"), away from zero when the smaller; exact decimals,
    so a case's distance from the bound is its factor, far above float rounding."""
    x = Decimal(value)
    step = (Decimal(factor) * Decimal(rel_tol) * abs(x)).copy_sign(x)
    if of == "larger":
        return format(x - step, "f")
    return format(x + step, "f")


NEAR_VALUES = ("0.000001", "0.001", "1.5", "-2.5", "123456.789", "-1000000.5", "1000000000000.5")
# (answer, other, rel_tol, equal?): 0.5, 0.99 of rel_tol of the larger inside; 1.001, 1.01, 2 out
NEAR_BOUND = [(v, near_bound(v, t, f, "larger"), float(t), Decimal(f) < 1) for v in NEAR_VALUES
              for t in ("1e-6", "0.001", "0.05") for f in ("0.5", "0.99", "1.001", "1.01", "2")]
# 5.05 % of the smaller is 4.81 % of the larger (inside 5 %); 5.3 % of it is 5.03 % (outside)
NEAR_BOUND += [(v, near_bound(v, "0.05", f, "smaller"), 0.05, f == "1.01") for v in NEAR_VALUES
               for f in ("1.01", "1.06")]


@pytest.mark.fast
@pytest.mark.parametrize("answer,other,tol,expected", NEAR_BOUND)
def test_plain_decimal_tolerance_just_inside_and_outside_the_bound(answer, other, tol, expected):
    """rewards._quick_equal's rel_tol · max(|a|, |b|), just inside and just outside at 10^-6 to
    10^12, negatives, rel_tol 10^-6 to 0.05, both ways round and through R.verify: a looser bound
    (twice it, rel_tol · (|a| + |b|), 1.005 times it, of the smaller instead of the larger, an
    absolute slack of 10^-9) fails at several magnitudes. Before, the slack passed every test and
    the others failed only at PLAIN_DECIMALS' cases on or near the bound."""
    assert R.verify(B % answer, other, rel_tol=tol) is expected
    assert R.verify(B % other, answer, rel_tol=tol) is expected
    assert R._quick_equal(answer, other, tol) is expected
    assert R._quick_equal(other, answer, tol) is expected
