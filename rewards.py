"""Rule-based math answer checking: the reward for GRPO and the metric for evaluation.
verify(completion, gold) -> bool;
score_batch(completions, golds, cfg) -> Scored(rewards, correct, metrics, answers)
"""
# Pipeline, cheapest first:
#   1. Extract the final answer: the last \boxed{} (boxes divided only by ",", "and", \quad form one
#      list), "final answer is", "the answer is", an "Answer:" line (the DAPO prompt's format) or
#      GSM8K "####", whichever comes last. With `last_number_fallback` (for eval) else the last $..$
#      span, a short formula or the last number.
#   2. Normalise it (\left, spaces, \dfrac, \text, units, $, thousands, mixed numbers, ratios,
#      matrices). Some answers have two readings and either may match: "28%" is 28 or 7/25, "3,5" is
#      3.5 or the list 3, 5.
#   3. Equal strings and plain numbers (compared with Fraction) are decided in-process. The rest
#      goes to a worker process that parses both sides and compares them: structure first (_same),
#      then values at two sample points within `rel_tol`, then simplify(a - b) == 0.
# Safety, since completions are untrusted text: model text is never evaluated; nothing calls eval,
# exec, sympify or parse_expr. LaTeX becomes the text of a Python expression whose names are all
# made here (v0, v1, F_sin); ast.parse reads it (it is never compiled) and a whitelisting walker
# builds sympy objects. Length (which bounds every number) and nesting are bounded first; powers and
# factorials are size-checked before sympy computes them. Slow work runs in memory-capped worker
# processes (fresh interpreters: no torch threads, no re-import of the trainer), killed and replaced
# past `timeout` per answer (reward/timeouts); past `batch_budget` per batch the answers not yet
# verified count as wrong (reward/over_budget), so a batch of hostile answers cannot stall a step.
# Importing this module loads only the standard library; sympy is imported by the workers.

import ast
import atexit
import itertools
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache, partial
from typing import NamedTuple

sympy = None  # imported by _parse, so that importing this module stays cheap


@dataclass
class RewardConfig:
    correct: float = 1.0
    """reward for an answer equal to the gold answer"""
    wrong: float = 0.0
    """reward for an extracted answer that is not equal (a timeout counts as wrong)"""
    no_answer: float = 0.0
    """reward when no final answer can be extracted"""
    format_bonus: float = 0.0
    """added to the reward whenever the completion contains a \\boxed{} answer"""
    timeout: float = 2.0
    """seconds per verification in a worker process; a hard limit (the worker is killed)"""
    batch_budget: float = 30.0
    """seconds for the worker jobs of one score_batch call; answers unverified then are wrong"""
    last_number_fallback: bool = False
    """without boxed/"answer is"/####, take the last math span or number (lenient, for eval)"""
    rel_tol: float = 1e-6
    """relative tolerance for decimals and irrationals: 1.414214 is sqrt(2), 3.1416 is not pi"""
    workers: int = 2
    """verifier worker processes, started on first use and kept until exit"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the last this-many tokens before max_new_tokens (0 = off)"""
    overlong_factor: float = 1.0
    """the penalty reaches −overlong_factor at max_new_tokens, falling linearly across the buffer"""

    def check(self) -> dict[str, tuple[bool, str]]:
        """{field: (ok, what it must be)} for each field that could be nonsense; never raises."""
        num = {k: _as_float(v) for k, v in vars(self).items()}  # nan: every comparison is False
        rules = {}
        for k in ("timeout", "batch_budget"):
            rules[k] = (0 < num[k] < math.inf, "> 0 and finite")
        few = isinstance(self.workers, int) and 1 <= num["workers"] <= 256
        rules["workers"] = (few, "an integer in [1, 256] (each a process)")
        buffer = isinstance(self.overlong_buffer, int) and num["overlong_buffer"] >= 0
        rules["overlong_buffer"] = (buffer, "an integer ≥ 0")
        for k in ("rel_tol", "overlong_factor"):
            rules[k] = (0 <= num[k] < math.inf, "≥ 0 and finite")
        for k in ("correct", "wrong", "no_answer", "format_bonus"):
            rules[k] = (math.isfinite(num[k]), "finite")
        return rules

    def bounds(self) -> tuple[float, float]:
        """(smallest, largest) reward one completion can get, so a group's mean too: an outcome's
        reward (correct, wrong, no_answer), the format bonus if it has a box, the overlong penalty
        (down to −overlong_factor) when it is on."""
        outcomes = (self.correct, self.wrong, self.no_answer)
        penalty = self.overlong_factor if self.overlong_buffer > 0 else 0
        low = min(outcomes) + min(0, self.format_bonus) - penalty
        return low, max(outcomes) + max(0, self.format_bonus)


def _as_float(v) -> float:  # nan for what is not a number; an integer too large for a float is ±inf
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


MAX_TEXT = 20_000  # only the tail of a completion is searched: the final answer is at the end
# longest answer we parse, which bounds every literal (MATH-500 answers have at most 53 characters)
MAX_ANSWER = 400
MAX_DEPTH = 40  # bracket nesting
MAX_BITS = 30_000  # largest integer a power may build (~9,000 digits)
MAX_FACTORIAL = 1_000

# ---------------------------------------------------------------------------------- extraction
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# $$..$$, \[..\], \(..\) or $..$; $\$5$ holds an escaped $
_SPAN = re.compile(r"\$\$(.{1,2000}?)\$\$|\\\[(.{1,2000}?)\\\]|\\\(([^\n]{1,500}?)\\\)"
                   r"|(?<![\\$])\$(?!\$)((?:[^$\n\\]|\\.){1,500}?)\$", re.DOTALL)
_PHRASE = re.compile(r"(?im)(?:final answer|the answer|^[ \t*#>]*answer\b)"
                     r"(?:[^.\n]|\.\d){0,100}?(?:\bis\b|:)[ \t*]*")
_HASHES = re.compile(r"####[ \t]*([^\n]{1,100})")
_SENTENCE_END = re.compile(r"\.(?!\d)|\n|I hope")
_JOIN = re.compile(r"(?:\s|[,;$]|\\[()\[\]]|\\q?quad|\\text\{\s*(?:and|or)\s*\}|\band\b|\bor\b)*")
_NUMBER = re.compile(r"(?<![A-Za-z0-9.,])-?(?:[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+)(?:/[0-9]+)?")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")


# (start, answer, end) of the last (start, end, answer) piece, joined with the pieces before it
# that only a separator divides from it: "\boxed{1}, \boxed{2}" is the list "1, 2". math-verify also
# joins boxes across any gap under 10 characters or a phrase with "and"/"," in it; we do not, on
# purpose: "\boxed{5}. Wait, it is \boxed{7}" is a correction, and reading it as the list 5, 7 would
# punish a model for correcting itself.
def _joined(pieces, text):
    start, end, answer = pieces[-1]
    parts = [answer]
    for s, e, a in reversed(pieces[:-1]):
        gap = text[e:start]
        if e > start or len(parts) >= 10 or len(gap) > 60 or not _JOIN.fullmatch(gap):
            break
        parts.insert(0, a)
        start = s
    return start, ", ".join(parts), end


def _last_boxed(text):  # the last 20 boxes at most; unclosed or overlong boxes are ignored
    boxes = []
    for m in list(_BOX.finditer(text))[-20:]:
        answer, end = _read_argument(text[:m.end() + MAX_ANSWER], m.end() - 1)
        if answer is not None:
            boxes.append((m.start(), end, answer))
    return _joined(sorted(boxes, key=lambda b: b[1]), text) if boxes else None


def _span_text(m):  # the text inside a _SPAN match
    return next(g for g in m.groups() if g)


def _last_span(text):
    spans = [(m.start(), m.end(), _span_text(m)) for m in _SPAN.finditer(text)]
    return _joined(spans, text) if spans else None


def _mathlike(s):  # a formula or a one-word answer, not a sentence
    n = _normalize(s)
    if not 0 < len(n) <= MAX_ANSWER:
        return False
    return not _WORD.search(n) or re.fullmatch(r"[A-Za-z]{1,30}", n)


def _last_phrase(text, fallback):
    phrases = list(_PHRASE.finditer(text))
    if not phrases:
        return None
    tail = text[phrases[-1].end():phrases[-1].end() + 300]
    span = _SPAN.match(tail)
    answer = _span_text(span) if span else _SENTENCE_END.split(tail, 1)[0]
    # a sentence: "the volume of $V$ is 120", "Jane started 3 hours ago", "6 (not 5)"
    if not _mathlike(answer):
        answer = re.split(r"\bis\b", answer)[-1]
        if not _mathlike(answer):
            span = _SPAN.search(answer)
            numbers = _NUMBER.findall(answer) if fallback else []
            if span:
                answer = _span_text(span)
            else:
                answer = numbers[0] if numbers else None
    return (phrases[-1].start(), answer) if answer else None


def extract_answer(text: str, last_number_fallback: bool = False) -> str | None:
    """The final answer in a completion, or None if there is none."""
    text = str(text)[-MAX_TEXT:]
    found = [_last_boxed(text), _last_phrase(text, last_number_fallback)]
    hashes = list(_HASHES.finditer(text))
    if hashes:
        found.append((hashes[-1].start(), hashes[-1][1]))
    found = [f[:2] for f in found if f and f[1].strip()]
    if found:
        return max(found)[1].strip()
    if not last_number_fallback:
        return None
    text = text[-4000:]  # the span regex is bounded but not linear
    span = _last_span(text)
    numbers = list(_NUMBER.finditer(text))
    if span and not (numbers and numbers[-1].start() > span[2]):  # "$\Delta x$ ... by 100%"
        return span[1].strip() or None
    if not span and (text.count("$") >= 2 or "\\(" in text or "\\[" in text):
        return None  # LaTeX opened but never closed: do not guess a number from inside it
    if len(text) <= 100 and _mathlike(text):
        return text.strip()
    return numbers[-1].group().rstrip(",") if numbers else None


# ------------------------------------------------------------------------------- normalisation
_UNICODE = str.maketrans({"−": "-", "×": "*", "·": "*", "÷": "/", "≤": "\\le ", "≥": "\\ge ",
                          "≠": "\\ne ", "π": "\\pi ", "∞": "\\infty ", "√": "\\sqrt", "∪": "\\cup ",
                          "°": ""})
_UNWRAP = (r"\\(?:text\w*|mbox|math\w+|operatorname|boxed|fbox|overline|overrightarrow|vec|hat"
           r"|widehat)\s*\{([^{}]*)\}")
# a word after a space, or a known unit after a number: 2xy keeps its xy
_UNIT = (r"(?:\s+(?:[A-Za-z]{2,}|[A-Za-z]+/[A-Za-z]+)"
         r"|\s*(?:[ckm]m|kg|mg|ft|mi|mph|min|sec|hrs?|inch(?:es)?|feet|cups?"
         r"|dollars?|cents?|units?|degrees?|meters?)(?:/[A-Za-z]+)?)\b(?:\^\{?\d\}?)?")
_RULES = [(re.compile(p), r) for p, r in [
    (r"\\[dtc]frac", r"\\frac"),
    (r"\\[dt]binom", r"\\binom"),
    (r"\\sqrt\s*\[([^\]]*)\]", r"\\root{\1}"),
    (r",\\!\s*|\{,\}", ","),
    (r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])\.?", ""),
    (r"\\([lg]e|ne)q?(?:slant)?(?![A-Za-z])", r"\\\1"),  # \leq, \leqslant -> \le
    (r"(?<!\\)\\[,;:! ]|\\q?quad|\\displaystyle|~|\\angle", " "),
    (r"(?<=\d) (?=\d{3}\b)", ""),  # 1 000 000
    # 4\text{ m}
    (r"(?<=[\d}.])\s*\\(?:text\w*|mbox|mathrm)\s*\{\s*[A-Za-z][^{}]*\}(?:\^\{?\d\}?)?\s*$", ""),
    (r"\\mathbb\s*\{?R\}?", r"(-\\infty, \\infty)"),
    (r"\\l(floor|ceil)\b", r"\\\1("),
    (r"\\r(?:floor|ceil)\b", ")"),
    (_UNWRAP, r"\1"),
    (_UNWRAP, r"\1"),  # twice: \text{\textbf{..}} nests
    (r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree", ""),
    (r"\s*(?:\\%|\b(?:percent(?:age)?|pct)\b)", "%"),
    (r"\\?\$|[€£¥]", ""),
    (r"^\s*([A-Za-z])\s*\\approx", r"\1="),  # x \approx 2
    (r"\\approx.*", ""),  # 1 \approx .9
    # "x \in [0, 1)" is the interval; "(x, y) \in \{..\}"
    (r"^\s*(?:[A-Za-z]|\([A-Za-z, ]+\))\s*\\in\s*", ""),
    (r",?\s*\b(?:and|or)\b\s*", ","),  # "19, 46, and 82", "(1,2) or (2,1)"
    (r";", ","),
    (r",\s*,", ","),
    (rf"(?<=[\d}}).%])(?:{_UNIT})+\s*$", ""),  # units: "5 cm^2", "5cm", "3 km/h", "2\frac12 hours"
    # 2\frac13, 2\frac{1}{3}
    (r"(?<![\d.^_{}A-Za-z\\])(\d+)\s*\\frac\s*(?:\{(\d+)\}|(\d))\s*(?:\{(\d+)\}|(\d))",
     r"(\1+\2\3/\4\5)"),
    (r"^(-?)(\d+) +(\d+)/(\d+)$", r"\1(\2+\3/\4)"),  # 2 1/3 (math-verify reads 1 here)
    # a ratio 2:3 is 2/3, as in math-verify; so is 1:2:3 (1/2)/3, which is wrong but rare
    (r":", "/"),
]]
_THOUSANDS = re.compile(r"(?<![\d.,(\[])[1-9]\d{0,2}(?:,\d{3})+(?=$|[^\d,)\]])")
_PLAIN = re.compile(r"-?(?:\d{1,40}(?:\.\d{1,40})?|\.\d{1,40})(?:/\d{1,40})?")
_MATRIX = re.compile(r"\\begin\{([pbBvV]?matrix|array)\}(?:\{[^{}]*\})?(.*?)\\end\{\1\}")


# \begin{pmatrix} a & b \\ c & d \end{pmatrix} -> \mat(\row(a, b), \row(c, d)); vmatrix: det
def _matrix(m):
    rows = ", ".join(f"\\row({r.replace('&', ',')})" for r in m[2].split("\\\\") if r.strip())
    return f"\\det(\\mat({rows}))" if m[1] == "vmatrix" else f"\\mat({rows})"


def _normalize(s: str) -> str:  # string clean-up for prediction and gold: no nested repeats
    s = str(s)[:MAX_TEXT].translate(_UNICODE)
    if len(s) > 4 * MAX_ANSWER:
        return s  # too long to be an answer; the parser refuses it
    if "matrix" not in s and "array" not in s:
        s = s.replace("\\\\", "\\")  # text escaped twice: \\frac -> \frac
    for pattern, repl in _RULES:
        s = pattern.sub(repl, s)
    s = _MATRIX.sub(_matrix, s)
    s = s.strip().lstrip(",;:").rstrip(" .,;:")  # keep the dot of ".4"
    s = _THOUSANDS.sub(lambda m: m.group().replace(",", ""), s)
    s = re.sub(r"^(-?)\\frac\{(-?\d+)\}\{(\d+)\}$", r"\1\2/\3", s)  # a plain fraction: fast path
    if re.fullmatch(r"\{[^{}]*\}|\([A-Za-z]\)", s):
        return s[1:-1].strip()  # "{1, 2, 3}"; a choice "(C)"
    return s


# normalised readings: the answer is right if one matches a gold reading
def _readings(answer: str) -> tuple:
    s = _normalize(answer)
    base = s.replace("%", "").strip()
    readings = [base]
    if s.endswith("%") and _PLAIN.fullmatch(base) and not re.search(r"/0+$", base):
        readings.append(str(_fraction(base) / 100))  # 28% is 28 or 0.28
    whole, _, decimals = base.partition(",")
    if re.fullmatch(r"-?\d+,\d+", base) and (whole in ("0", "-0") or len(decimals) != 3):
        readings.append(f"{whole}.{decimals}")  # 2,5 or 0,125
    return tuple(readings)


def _canon(s):  # key for string equality: spaces only between two letters; words ignore case
    s = re.sub(r"\s(?![A-Za-z])|(?<![A-Za-z])\s", "", re.sub(r"\s+", " ", s))
    return s.lower() if re.fullmatch(r"[A-Za-z][A-Za-z ]*", s) else s


def _fraction(x: str) -> Fraction:  # "2", "-.5", "1.5/2": Fraction refuses a decimal numerator
    num, _, den = x.partition("/")
    return Fraction(num) / Fraction(den or 1)


def _quick_equal(pred, gold, rel_tol):  # True/False if decidable without sympy; None: ask a worker
    if _canon(pred) == _canon(gold) or not pred:
        return bool(pred)
    if not (_PLAIN.fullmatch(pred) and _PLAIN.fullmatch(gold)):
        return None
    if re.search(r"/0+( |$)", pred + " " + gold):
        return None
    a, b = _fraction(pred), _fraction(gold)  # a decimal approximates, as Floats do in the worker
    if "." in pred + gold:
        return abs(a - b) <= rel_tol * max(abs(a), abs(b))
    return a == b


# ------------------------------------------------------------------------------------ parser
@dataclass(frozen=True)
class _Rel:
    parts: tuple  # a < b <= c  ->  parts (a, b, c), ops ("<", "<=")
    ops: tuple


_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?|\.\d+)"  # a number
                    r"|\\([A-Za-z]+)|([A-Za-z]+'*)"  # a command, a word
                    r"|(<=|>=|!=|\\[{}]|[-+*/^!(),\[\]{}=<>|]))")  # a symbol
_SUB = re.compile(r"\s*_\s*(?:\{([^{}]{1,40})\}|(\w))")
# n! becomes n[_], a subscript: it binds tighter than **
_OPS = {"=": "==", "<": "<", ">": ">", "<=": "<=", ">=": ">=", "!=": "!=",
        "\\le": "<=", "\\ge": ">=", "\\lt": "<", "\\gt": ">", "\\ne": "!=",
        "+": "+", "-": "-", "*": "*", "\\cdot": "*", "\\times": "*", "/": "/", "\\div": "/",
        "\\cup": "|", ",": ",", "^": "**", "!": "[_]"}
# \sin x, \log_2 8; \mat(\row(a, b), ..) is written by _matrix
_APPLY = {"sin", "cos", "tan", "sec", "csc", "cot", "arcsin", "arccos", "arctan",
          "ln", "log", "exp", "floor", "ceil", "mat", "row", "det"}
_CONST = {"e": "Exp1", "i": "ImaginaryUnit", "pi": "Pi", "infty": "Infinity",
          "emptyset": "EmptySet", "varnothing": "EmptySet", "True": "true", "False": "false"}


# The LaTeX argument at s[i:] after any spaces: the inside of a balanced {group}, a command or one
# character; and the index after it. (None, i) when there is none.
def _read_argument(s, i):
    i += len(s[i:]) - len(s[i:].lstrip())
    if s[i:i + 1] == "{":
        depth = 0
        for j in range(i, len(s)):
            depth += (s[j] == "{") - (s[j] == "}")
            if depth == 0:
                return s[i + 1:j], j + 1
    m = re.compile(r"\\[A-Za-z]+|[^\s{}]").match(s, i)
    return (m.group(), m.end()) if m else (None, i)


def _name(text, names):  # a number, constant or symbol under a name made here, for _build
    if text in _CONST:
        value = getattr(sympy.S, _CONST[text])
    elif not re.fullmatch(r"[\d.]+", text):
        value = sympy.Symbol(text)
    elif "." in text:
        value = sympy.Float(text, max(15, len(text)))
    else:
        value = sympy.Integer(text)
    names[f"v{len(names)}"] = value
    return f"v{len(names) - 1}"


# LaTeX -> the text of a Python expression; `names` records what its names (v0, v1, ..) stand for.
# Juxtaposed operands get a "*"; brackets become groups, tuples or intervals F_Interval(a, b,
# left_open, right_open); \{..\} becomes F_set(..), |x| F_abs(x), n! n[_], \frac{a}{b} ((a)/(b)),
# and \sin 2x F_sin(2*x) (the argument runs up to the next operator). The text holds no name,
# attribute or keyword taken from the answer.
def _to_python(s, names):
    out = []
    stack = [["", 0, 0, ""]]  # open brackets and functions: [opener, index in out, commas, closing]
    operand = False  # out ends with an operand
    pos = 0
    while pos < len(s.rstrip()):
        m = _TOKEN.match(s, pos)
        if not m:
            raise ValueError(f"unexpected {s[pos:pos + 10]!r}")
        pos = m.end()
        num, cmd, word, sym = m.groups()
        tok = "\\" + cmd if cmd else sym
        fn = (cmd or word) in _APPLY
        is_operand = num or word or (cmd and tok not in _OPS)
        if operand and not (is_operand and not fn or sym in tuple("^!([{")):
            while stack[-1][0] == "fn":  # \sin 2x + 1: the argument ends before the "+"
                out.append(stack.pop()[3])
        sub = None
        sub_match = (num or word or cmd) and _SUB.match(s, pos)
        if sub_match:
            pos = sub_match.end()
            sub = sub_match[1] or sub_match[2]
        if is_operand:
            text, pos = _operand(s, pos, names, out, stack, m.groups(), sub)
            starts = True
            ends = not fn
        else:
            text, starts, ends = _symbol(tok, operand, out, stack, names)
        out.append(" * " + text if starts and operand else text)
        operand = ends
    while stack[-1][0] == "fn":
        out.append(stack.pop()[3])
    return "".join(out)  # unbalanced brackets leave unbalanced parentheses: ast.parse refuses them


# The text of a number, word, function or command token, and the position after it.
def _operand(s, pos, names, out, stack, groups, sub):
    num, cmd, word, _ = groups
    if num:
        return _name(f"{num}_{sub}" if sub else num, names), pos  # 52_8: base 8, an opaque name
    if (cmd or word) in _APPLY:
        close = f", {_to_python(sub, names)})" if sub else ")"  # \log_2 8
        if s[pos:].lstrip().startswith("^"):  # \sin^2 x is (\sin x)^2
            power, pos = _read_argument(s, s.index("^", pos) + 1)
            close += f"**({_to_python(power, names)})"
        stack.append(["fn", len(out), 0, close])
        return f"F_{cmd or word}(", pos
    if word:  # "xy" is x*y; a longer word ("even", "Evelyn") is one name
        letters = [word] if len(word) > 2 or word == "pi" else list(word)
        letters[-1] += f"_{sub}" if sub else ""
        return " * ".join(_name(x, names) for x in letters), pos
    if cmd in ("frac", "binom", "root", "sqrt"):  # \frac{a}{b} -> ((a)/(b)); \sqrt2 -> F_sqrt((2))
        args = []
        for _ in range(1 if cmd == "sqrt" else 2):
            arg, pos = _read_argument(s, pos)
            args.append(f"({_to_python(arg, names)})")
        if cmd == "frac":
            return f"({args[0]}/{args[1]})", pos
        return f"F_{cmd}({', '.join(args)})", pos
    return _name(cmd + (f"_{sub}" if sub else ""), names), pos  # \alpha: a name; \pi: a constant


# (text, starts an operand, ends an operand) of an operator or a bracket.
def _symbol(tok, operand, out, stack, names):
    if tok in _OPS:
        stack[-1][2] += tok == ","
        return f" {_OPS[tok]} ", False, tok == "!"
    if tok in (")", "]", "}", "\\}") or tok == "|" and operand and stack[-1][0] == "|":
        kind, at, commas, _ = stack.pop()
        if kind + tok in ("[]", "[)", "(]") and commas == 1:  # [a, b) is an interval
            out[at] = out[at][:-1] + "F_Interval("
            left_open = _name(str(kind == "("), names)
            right_open = _name(str(tok == ")"), names)
            return f", {left_open}, {right_open})", False, True
        return ")", False, True
    stack.append([tok, len(out), 0, ")"])
    return {"\\{": "F_set(", "|": "F_abs("}.get(tok, "("), True, False


def _pow(base, exp):  # refused: x^(10^6), and powers whose integer would have over MAX_BITS bits
    bits = max(abs(base.p), abs(base.q), 2).bit_length() if base.is_Rational else 1
    if exp.is_Number and base not in (0, 1, -1):
        if abs(exp) > 10_000 or abs(float(exp)) * bits > MAX_BITS:
            raise ValueError("power")
    return base ** exp


def _small_int(n):  # the argument of a factorial or binomial: a small integer, or symbolic
    if n.is_number and not (n.is_Integer and 0 <= n <= MAX_FACTORIAL):
        raise ValueError("factorial")
    return n


def _expr(x):
    if not isinstance(x, (sympy.Expr, sympy.MatrixBase)):
        raise TypeError("arithmetic on a list, set or relation")
    return x


def _mat(rows):  # F_mat(rows): a tuple of rows, or the elements of one row
    if isinstance(rows[0], tuple):
        return sympy.ImmutableMatrix([*map(list, rows)])
    return sympy.ImmutableMatrix([list(rows)])


@lru_cache(maxsize=1)
def _functions():  # F_name -> what it builds
    names = ("sin", "cos", "tan", "sec", "csc", "cot", "log", "exp", "floor", "sqrt")
    f = {k: getattr(sympy, k) for k in names}
    f |= {"arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan}
    f |= {"ln": sympy.log, "ceil": sympy.ceiling, "abs": sympy.Abs, "Interval": sympy.Interval}
    f["set"] = lambda *xs: list(xs)
    f["root"] = lambda n, x: sympy.root(x, n)
    f["det"] = lambda m: m.det()
    f["binom"] = lambda n, k: sympy.binomial(_small_int(n), k)
    f["row"] = lambda r: r if isinstance(r, tuple) else (r,)
    f["mat"] = _mat
    return {"F_" + k: v for k, v in f.items()}


_ARITH = {ast.Add: "__add__", ast.Sub: "__sub__", ast.Mult: "__mul__", ast.Div: "__truediv__",
          ast.Pow: None}
_CMP = {ast.Eq: "=", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}


# A sympy object, tuple, list or _Rel from a node of the text _to_python wrote. Only these node
# types are accepted, and only the names _to_python made; nothing is compiled or evaluated by
# Python. Recursion is bounded by the answer's length (a RecursionError only means "not equal").
def _build(node, names):
    sub = partial(_build, names=names)
    t = type(node)
    op = type(getattr(node, "op", None))
    if t is ast.Name and node.id in names:
        return names[node.id]
    if t is ast.BinOp and op is ast.BitOr:  # \cup
        return sympy.Union(_as_set(sub(node.left)), _as_set(sub(node.right)))
    if t is ast.BinOp and op in _ARITH:
        a, b = _expr(sub(node.left)), _expr(sub(node.right))
        return _pow(a, b) if op is ast.Pow else getattr(a, _ARITH[op])(b)
    if t is ast.UnaryOp and op in (ast.USub, ast.UAdd):
        x = _expr(sub(node.operand))
        return -x if op is ast.USub else x
    if t is ast.Call and type(node.func) is ast.Name and not node.keywords:
        if node.func.id in _functions():
            return _functions()[node.func.id](*map(sub, node.args))
    if t is ast.Subscript and type(node.slice) is ast.Name and node.slice.id == "_":  # n!
        return sympy.factorial(_small_int(_expr(sub(node.value))))
    if t in (ast.Tuple, ast.List):
        return (tuple if t is ast.Tuple else list)(map(sub, node.elts))
    if t is ast.Compare:
        parts = tuple(map(sub, [node.left, *node.comparators]))
        return _Rel(parts, tuple(_CMP[type(o)] for o in node.ops))
    raise ValueError(f"node {t.__name__}")


def _parse(s):  # normalised answer -> sympy object, tuple, list (in any order) or _Rel
    global sympy
    import sympy
    depth = max(itertools.accumulate((c in "([{") - (c in ")]}") for c in s), default=0)
    if len(s) > MAX_ANSWER or depth > MAX_DEPTH:
        raise ValueError("too long or too deeply nested")  # before any recursion
    pieces = re.split(r"\\pm|\\mp", s)
    if len(pieces) > 4:
        raise ValueError("too many \\pm")
    values = []  # 1 \pm \sqrt{19} is the list of both values
    for signs in itertools.product("+-", repeat=len(pieces) - 1):
        names = {}
        text = pieces[0] + "".join(sign + piece for sign, piece in zip(signs, pieces[1:]))
        items = _build(ast.parse(f"[{_to_python(text, names)}]", mode="eval").body, names)
        values.append(items[0] if len(items) == 1 else items)
    if len(values) == 1:
        return values[0]
    flat = []
    for v in values:
        flat.extend(v if isinstance(v, list) else [v])
    return flat


# -------------------------------------------------------------------------------- comparison
# True/False from values at two sample points; None if they cannot be computed
def _numeric_close(a, b, tol):
    syms = sorted(a.free_symbols | b.free_symbols, key=str)
    if len(syms) > 20:
        return None  # too many symbols to trust two points: ask simplify
    try:
        for k in (1, 2):  # distinct, irrational-looking values in (0.25, 1.25)
            step = 0.7548776662 + 0.3141592 * k
            subs = {x: 0.25 + ((i + 1) * step) % 1 for i, x in enumerate(syms)}
            x, y = a.evalf(30, subs=subs), b.evalf(30, subs=subs)
            if not (x.is_number and y.is_number and x.is_finite and y.is_finite):
                return None  # compare sympy Floats: 1e1989 must not overflow to inf == inf
            if not bool(abs(x - y) <= tol * max(abs(x), abs(y)) + 1e-15):
                return False
        return True
    except (TypeError, ValueError, ArithmeticError):
        return None


def _same_expr(a, b, tol):
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)) or a == b:
        return a == b
    if a.has(sympy.nan, sympy.zoo) or b.has(sympy.nan, sympy.zoo):
        return False  # 1/0
    if a.is_Rational and b.is_Rational:
        return False  # exact numbers that differ (no tolerance for 1000000 vs 1000001)
    close = _numeric_close(a, b, tol)
    return close if close is not None else sympy.simplify(a - b) == 0


def _is_eq(x):  # an equation, or a chain of them: x = 2 + 3 = 5
    return isinstance(x, _Rel) and set(x.ops) == {"="}


# x, f(x), AB/BC, m+n, (p, q): made of symbols only, it names a value (as in math-verify)
def _is_name(e):
    if isinstance(e, tuple):
        return bool(e) and all(map(_is_name, e))
    if not isinstance(e, sympy.Expr) or e.is_Symbol:
        return isinstance(e, sympy.Symbol)
    if e.is_Pow and e.exp == -1:
        return _is_name(e.args[0])
    parts = e.args if e.is_Add or e.is_Mul or e.is_Function else ()
    return bool(parts) and all(map(_is_name, parts))


# [x=1, y=2, x=3, y=4] -> [(1, 2), (3, 4)]: a tuple per solution, its variables in name order, so
# that "y = 2, x = 1" is the pair (1, 2). math-verify keeps the written order and flattens
# "x=1, y=2 and x=3, y=4".
def _solutions(x):
    if not isinstance(x, list):
        return x
    if not all(_is_eq(e) and isinstance(e.parts[0], sympy.Symbol) for e in x):
        return x
    runs = []  # {variable: value} per solution
    for e in x:
        if not runs or e.parts[0] in runs[-1]:
            runs.append({})
        runs[-1][e.parts[0]] = e.parts[-1]
    if len(runs[0]) < 2:
        return x  # x = 2, x = 3: a list
    solutions = [tuple(r[k] for k in sorted(r, key=str)) for r in runs]
    return solutions[0] if len(solutions) == 1 else solutions


def _as_set(x):
    items = x if isinstance(x, list) else [x]
    if isinstance(x, _Rel) or isinstance(x, list) and x and all(isinstance(e, _Rel) for e in x):
        return sympy.Union(*map(_rel_to_set, items))  # x < -2 or x > 2
    if type(x) is tuple and len(x) == 2:
        return sympy.Interval.open(*x)  # (a, b) is a point or an open interval; here the interval
    if isinstance(x, (list, sympy.Expr)):
        return sympy.FiniteSet(*items)
    return x


def _oriented(r):  # a > b >= c  ->  c <= b < a, so that equal relations have equal parts and ops
    if not r.ops or not all(op in (">", ">=") for op in r.ops):
        return r
    return _Rel(r.parts[::-1], tuple(op.replace(">", "<") for op in r.ops[::-1]))


def _rel_to_set(r):  # x > 3 -> (3, oo); 1 <= |z| <= 3/2 and x != 1 are solved for x
    r = _oriented(r)
    relations = {"<": sympy.Lt, "<=": sympy.Le, "!=": sympy.Ne}
    syms = set().union(*(p.free_symbols for p in r.parts))
    if not all(op in relations for op in r.ops) or len(syms) != 1 and len(r.parts) != 3:
        raise ValueError("not an inequality in one variable")
    # 0 < f(x) < 1 is an interval of f(x)
    if len(r.parts) == 3 and "!=" not in r.ops and (len(syms) != 1 or r.parts[1].is_Symbol):
        return sympy.Interval(r.parts[0], r.parts[2], r.ops[0] == "<", r.ops[1] == "<")
    x = syms.pop()
    result = sympy.S.Reals
    for low, op, high in zip(r.parts, r.ops, r.parts[1:]):
        result &= sympy.solveset(relations[op](low, high), x, sympy.S.Reals)
    return result


def _sides(r):  # (left, right) of an equation; a chain "2 + 3 = n = 5" is (n, 5)
    return next(filter(_is_name, r.parts[:-1]), r.parts[0]), r.parts[-1]


# Relations: an interval or union against an inequality in one variable, in both directions
# (math-verify only when the prediction is the set, unless its set/relation option is on); equations
# up to a constant factor; inequalities once both point the same way, as written or times -1.
# math-verify compares the relations of a chain pairwise, so it finds 5 > x > 2 unequal to
# 2 < x < 5; orienting first fixes that.
def _same_rel(g, p, tol):
    same = partial(_same, tol=tol)
    if not (isinstance(g, _Rel) and isinstance(p, _Rel)):  # x > 3 against (3, \infty)
        other = p if isinstance(g, _Rel) else g
        return isinstance(other, (tuple, list, sympy.Set)) and same(_as_set(g), _as_set(p))
    if _is_eq(g) and _is_eq(p):  # both sides the same, or the same equation times a constant
        l1, r1 = _sides(g)
        l2, r2 = _sides(p)
        if same(l1, l2) and same(r1, r2) or same(l1, r2) and same(r1, l2):
            return True
        # 2x+4y-3=0 is y=-x/2+3/4
        ratio = sympy.simplify((_expr(l1) - _expr(r1)) / (_expr(l2) - _expr(r2)))
        return bool(ratio.is_number and ratio.is_finite and ratio != 0)
    g, p = _oriented(g), _oriented(p)
    flipped = _Rel(tuple(-_expr(x) for x in p.parts[::-1]), p.ops[::-1])  # -5 < -x < -2: 2 < x < 5
    for c in (p, flipped):
        if c.ops == g.ops and all(map(same, g.parts, c.parts)):
            return True
    return False


def _has_tuples(v):  # a tuple, or a list with a tuple in it
    return isinstance(v, tuple) or isinstance(v, list) and any(isinstance(e, tuple) for e in v)


def _items(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _set_parts(s):  # an interval by (start, end, left_open, right_open); a union by its parts
    return tuple(s.args) if s.is_Interval else list(s.args)


def _shape(v):  # a matrix's shape or a tuple's length; None for anything else
    return len(v) if isinstance(v, tuple) else getattr(v, "shape", None)


# Is the prediction p the gold g (strings or parsed)? Asymmetric where math-verify is.
def _same(g, p, tol):
    same = partial(_same, tol=tol)
    try:
        if isinstance(g, str):
            g, p = _parse(g), _parse(p)
        if _is_eq(p) and not isinstance(g, _Rel):
            p = p.parts[-1]  # "x = 2 + 3 = 5" answers 5
        elif _is_eq(g) and not isinstance(p, _Rel) and any(map(_is_name, g.parts[:-1])):
            g = g.parts[-1]  # a gold that names its value: "f(x) = 2x+1", "AB:BC = 2:3"
        if isinstance(g, _Rel) or isinstance(p, _Rel):
            return _same_rel(g, p, tol)
        g_tuples = _has_tuples(g)
        if _has_tuples(p):
            g = _solutions(g)
        if g_tuples:
            p = _solutions(p)
        if isinstance(g, sympy.Set) or isinstance(p, sympy.Set):
            g, p = _as_set(g), _as_set(p)
            if g == p:
                return True
            return type(g) is type(p) and same(_set_parts(g), _set_parts(p))
        if isinstance(g, list) or isinstance(p, list):
            xs, ys = _items(g), _items(p)
            if isinstance(g, tuple) or isinstance(p, tuple):  # a tuple fixes the order
                return len(xs) == len(ys) and all(map(same, xs, ys))
            every_x = all(any(same(x, y) for y in ys) for x in xs)
            return every_x and all(any(same(x, y) for x in xs) for y in ys)
        if isinstance(g, (tuple, sympy.MatrixBase)) or isinstance(p, (tuple, sympy.MatrixBase)):
            return _shape(g) == _shape(p) and all(map(same, g, p))  # in order, same shape
        return _same_expr(g, p, tol)
    except Exception:  # refused input or any sympy error means "not equal"
        return False


def _equivalent(preds, golds, rel_tol: float) -> bool:  # may be slow: only call it in a worker
    for p, g in itertools.product(preds, golds):
        if _quick_equal(p, g, rel_tol) or _same(g, p, rel_tol):
            return True
    return False


# ------------------------------------------------------------------------------ worker pool
# Persistent worker processes with a hard deadline per job: a worker past it is killed, reaped and
# replaced. Protocol: "ready" once, then one JSON job in and one "1"/"0" out; a worker never has two
# messages in flight, and each is a single atomic pipe write.
class _Pool:
    def __init__(self, n):
        self.procs = [self._spawn() for _ in range(n)]
        self.ready = set()  # pids of the workers that said "ready"
        self.busy = {}  # worker -> (job index, deadline)

    def _spawn(self):  # a fresh interpreter: no torch threads, and it never re-imports __main__
        command = [sys.executable, os.path.abspath(__file__), "--worker"]
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, bufsize=0)

    def _replace(self, p):
        p.kill()
        p.wait()  # reap it: no zombies
        self.ready.discard(p.pid)
        self.busy.pop(p, None)
        self.procs[self.procs.index(p)] = self._spawn()

    # (verdict per job: True/False, or None if it timed out, its worker died or the budget ran out;
    # how many jobs the budget left unanswered). Workers still busy when the budget ends are killed.
    def run(self, jobs, timeout, budget):
        results = [None] * len(jobs)
        todo = list(range(len(jobs)))[::-1]  # the next job is last
        busy = self.busy
        stop = time.monotonic() + budget
        while (todo or busy) and time.monotonic() < stop:
            idle = [p for p in self.procs if p.pid in self.ready and p not in busy]
            for p in idle[:len(todo)]:
                try:
                    p.stdin.write((json.dumps(jobs[todo[-1]]) + "\n").encode())
                    busy[p] = (todo.pop(), time.monotonic() + timeout)
                except OSError:  # it died while idle
                    self._replace(p)
            waiting = {p.stdout: p for p in self.procs if p in busy or p.pid not in self.ready}
            until = min([d for _, d in busy.values()] + [stop, time.monotonic() + 1])
            readable = select.select(list(waiting), [], [], max(0.0, until - time.monotonic()))[0]
            for f in readable:
                p = waiting[f]
                line = os.read(f.fileno(), 64)
                if line.startswith(b"ready"):
                    self.ready.add(p.pid)
                elif line and p in busy:
                    results[busy.pop(p)[0]] = line.startswith(b"1")
                else:  # EOF: the worker crashed (for example at its memory cap)
                    self._replace(p)
            for p in [p for p, (_, deadline) in busy.items() if time.monotonic() > deadline]:
                self._replace(p)
        unanswered = len(todo) + len(busy)
        for p in list(busy):
            self._replace(p)
        return results, unanswered

    def close(self):
        for p in self.procs:
            p.kill()
            p.wait()


_pool: _Pool | None = None  # one per process: started on first use, closed at exit
_pool_lock = threading.Lock()


def _run_jobs(jobs, cfg):
    global _pool
    with _pool_lock:
        if _pool is None or len(_pool.procs) != max(1, cfg.workers):
            if _pool is not None:
                _pool.close()
            _pool = _Pool(max(1, cfg.workers))
            atexit.register(_pool.close)
        return _pool.run(jobs, cfg.timeout, cfg.batch_budget)


def _serve():  # the worker loop: python rewards.py --worker
    import resource
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway job dies, not the host
    # import sympy, solveset and simplify's lazy imports before any deadline
    _equivalent(["1 \\le |x| \\le 2"], ["[-2, -1] \\cup [1, 2]"], 1e-6)
    sympy.simplify(sympy.sin(sympy.Symbol("x")) ** 2 - 1)
    os.write(1, b"ready\n")  # one write per message: the parent's single os.read sees it whole
    for line in sys.stdin:
        os.write(1, b"1\n" if _equivalent(*json.loads(line)) else b"0\n")


# -------------------------------------------------------------------------------- public API
@lru_cache(maxsize=4096)
def _gold_readings(gold: str) -> tuple:  # cached: the G completions of a group share one gold
    # the boxed or stated answer, else the last "$..$" span, else the text as it is
    return _readings(extract_answer(gold) or (_last_span(gold) or (0, gold))[1])


class Scored(NamedTuple):
    """score_batch's result, per completion but `metrics`."""

    rewards: list[float]
    correct: list[bool]
    metrics: dict
    answers: list[str | None]  # the extracted answer (None: none found)


def score_batch(completions: list[str], golds: list, cfg: RewardConfig) -> Scored:
    """Rewards, correctness, metrics and the answers read, for a batch; plain numbers never leave
    this process."""
    t0 = time.perf_counter()
    answers = [extract_answer(c, cfg.last_number_fallback) for c in completions]
    correct = []
    jobs = []  # (prediction readings, gold readings, rel_tol) that only a worker can decide
    where = []  # the completion of each job
    for i, (a, g) in enumerate(zip(answers, golds)):
        readings = (_readings(a), _gold_readings(str(g))) if a is not None else ((), ())
        verdicts = [_quick_equal(p, r, cfg.rel_tol) for p in readings[0] for r in readings[1]]
        correct.append(True in verdicts)
        if None in verdicts and not correct[i]:
            jobs.append((*readings, cfg.rel_tol))
            where.append(i)
    try:
        results, over_budget = _run_jobs(jobs, cfg) if jobs else ([], 0)
    except OSError:  # workers could not be started: everything sent counts as a timeout
        results, over_budget = [None] * len(jobs), 0
    for i, result in zip(where, results):
        correct[i] = bool(result)
    rewards = []
    for a, ok, c in zip(answers, correct, completions):
        reward = cfg.no_answer if a is None else cfg.correct if ok else cfg.wrong
        bonus = cfg.format_bonus if _BOX.search(str(c)[-MAX_TEXT:]) else 0.0
        rewards.append(reward + bonus)
    n = max(1, len(answers))
    metrics = {"reward/timeouts": sum(r is None for r in results) - over_budget,
               "reward/over_budget": over_budget,
               "reward/no_answer_frac": answers.count(None) / n,
               "reward/correct_frac": sum(correct) / n,
               "reward/worker_frac": len(jobs) / n,
               "reward/verify_seconds": time.perf_counter() - t0}
    return Scored(rewards, correct, metrics, answers)


def overlong_penalty(lengths, max_new_tokens: int, cfg: RewardConfig):
    """DAPO's soft overlong punishment for lengths (a tensor), added to the reward: 0 up to
    max_new_tokens − overlong_buffer, then linearly down to −overlong_factor at max_new_tokens."""
    if cfg.overlong_buffer <= 0:
        return 0.0 * lengths
    over = (lengths - (max_new_tokens - cfg.overlong_buffer)).clamp(min=0)
    return -cfg.overlong_factor * over / cfg.overlong_buffer


def verify(completion: str, gold: str, rel_tol: float = 1e-6, timeout: float = 2.0,
           last_number_fallback: bool = False) -> bool:
    """Is the completion's final answer equal to the gold answer? Never raises."""
    cfg = RewardConfig(rel_tol=rel_tol, timeout=timeout, last_number_fallback=last_number_fallback)
    try:
        return score_batch([completion], [gold], cfg)[1][0]
    except Exception:  # the contract is to never raise
        return False


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _serve()
