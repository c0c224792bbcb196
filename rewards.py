"""Rule-based math answer checking: the reward for GRPO and the metric for evaluation.

    verify(completion, gold) -> bool        math_reward(completion, gold, cfg) -> float
    score_batch(completions, golds, cfg) -> (rewards, correct, metrics)   # once per RL step

Pipeline, cheapest first:
  1. Extract: the last \\boxed{}/\\fbox{} (boxes separated only by ",", "and", \\quad form one
     list), "final answer is ...", "the answer is ...", GSM8K "#### N"; the latest one wins. With
     `last_number_fallback` (off for training) a completion without any of them gives its last
     $..$ span, the whole text if it is a short formula, or its last number. Gold answers use the
     same code and fall back to the whole string.
  2. Normalise both strings (\\left, spacing, \\dfrac, \\text, units, degrees, %, $, thousands
     separators, "x =" before a number, mixed numbers, trailing punctuation).
  3. Decide in-process when that is cheap and cannot hang: equal strings, or two plain numbers of
     bounded length compared exactly with fractions.Fraction (with `rel_tol` if one is a decimal).
  4. Otherwise a worker process parses both sides into sympy objects and compares them:
     structural equality -> exact rationals -> values at two sample points with a relative
     tolerance (a clear difference rejects at once, so wrong answers never pay for simplify) ->
     simplify(a - b) == 0 when no values can be computed. Tuples compare in order, lists and sets
     in any order, intervals by endpoints, relations after orienting them, "x = 3" or "f(x) = 1"
     by its right side, inequalities against intervals by solving them, matrices by entries.

Safety, since completions are untrusted text:
  * sympify/parse_expr call Python eval; nothing here does. A fixed-alphabet tokenizer and a
    recursive-descent parser build sympy objects directly (Integer, Float, Add, Pow, ...).
  * Answer length, bracket depth, recursion depth and digits per number are bounded before
    parsing; powers, factorials and binomials are size-checked before sympy evaluates them, so
    7^(7^(7^7)) or 50000! is refused rather than computed.
  * What may still be slow (simplify, big-integer C code that signals cannot interrupt, and
    signals only work in the main thread anyway) runs in a worker process that is killed and
    replaced when a job passes `timeout`; a timeout counts as wrong and is reported. Workers are
    fresh interpreters started by subprocess (fork+exec): they inherit no torch threads and never
    re-import the trainer's __main__ as multiprocessing's spawn would. They cap their memory.
  * `import rewards` loads only the standard library and starts nothing; sympy is imported on the
    first parse, which normally happens in a worker.
"""

import atexit
import itertools
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

sympy = None  # imported by _parse_answer, so that importing this module stays cheap


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
    last_number_fallback: bool = False
    """without boxed/"answer is"/####, take the last math span or number (lenient, for eval)"""
    rel_tol: float = 1e-6
    """relative tolerance for decimals and irrational values: 1.414214 is sqrt(2), 3.1416 is not pi"""
    workers: int = 2
    """verifier worker processes, started on first use and kept until exit"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the last this-many tokens before rollout.max_new_tokens (0 = off)"""
    overlong_factor: float = 1.0
    """the penalty reaches −overlong_factor at rollout.max_new_tokens, falling linearly across the buffer"""

    def check(self) -> list[tuple[bool, str]]:
        return [(self.overlong_buffer >= 0, f"reward.overlong_buffer must be ≥ 0 (0 = off), got {self.overlong_buffer}"),
                (0 <= self.overlong_factor < 1e6, f"reward.overlong_factor must be ≥ 0, got {self.overlong_factor}"),
                (0 < self.timeout < 1e6, f"reward.timeout must be > 0, got {self.timeout}"),
                (self.workers >= 1, f"reward.workers must be ≥ 1, got {self.workers}"),
                (0 <= self.rel_tol < 1, f"reward.rel_tol must be in [0, 1), got {self.rel_tol}")]


MAX_TEXT = 20_000  # only the tail of a completion is searched: the final answer is at the end
MAX_ANSWER = 400  # longest answer we parse (MATH-500 answers have at most 53 characters)
MAX_DEPTH = 40  # bracket nesting and parser recursion
MAX_DIGITS = 100  # digits in one number literal
MAX_BITS = 30_000  # largest integer a power may build (~9,000 digits)
MAX_FACTORIAL = 1_000

# ---------------------------------------------------------------------------------- extraction
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_SPAN = re.compile(r"\$\$(.{1,2000}?)\$\$|\\\[(.{1,2000}?)\\\]|\\\(([^\n]{1,500}?)\\\)"
                   r"|(?<![\\$])\$(?!\$)([^$\n]{1,500}?)(?<!\\)\$", re.DOTALL)
_PHRASE = re.compile(r"(?i)(?:final answer|the answer)(?:[^.\n]|\.\d){0,100}?(?:\bis\b|:)[ \t]*")
_HASHES = re.compile(r"####[ \t]*([^\n]{1,100})")
_SENTENCE_END = re.compile(r"\.(?!\d)|\n|I hope")
_JOIN = re.compile(r"(?:\s|[,;$]|\\[()\[\]]|\\q?quad|\\text\{\s*(?:and|or)\s*\}|\band\b|\bor\b)*")
_NUMBER = re.compile(r"(?<![A-Za-z0-9.,])-?(?:[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+)(?:/[0-9]+)?")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")


def _joined(pieces, text):
    """(start, answer, end) of the last (start, end, answer) piece, joined with the pieces before
    it that only a separator divides from it: "\\boxed{1}, \\boxed{2}" is the list "1, 2"."""
    start, end, answer = pieces[-1]
    parts = [answer]
    for s, e, a in reversed(pieces[:-1]):
        gap = text[e:start]
        if e > start or len(parts) >= 10 or len(gap) > 60 or not _JOIN.fullmatch(gap):
            break
        parts.insert(0, a)
        start = s
    return start, ", ".join(parts), end


def _last_boxed(text):
    boxes = []
    for m in list(_BOX.finditer(text))[-20:]:  # bounded work however many boxes there are
        depth, i, stop = 1, m.end(), min(len(text), m.end() + MAX_ANSWER)
        while i < stop and depth:
            depth += (text[i] == "{") - (text[i] == "}")
            i += 1
        if depth == 0:  # unclosed or overlong boxes are ignored
            boxes.append((m.start(), i, text[m.end():i - 1]))
    return _joined(sorted(boxes, key=lambda b: b[1]), text) if boxes else None


def _last_span(text):
    spans = [(m.start(), m.end(), next(g for g in m.groups() if g)) for m in _SPAN.finditer(text)]
    return _joined(spans, text) if spans else None


def _mathlike(s):
    """A formula or a one-word answer, not a sentence."""
    n = _normalize(s)
    return 0 < len(n) <= MAX_ANSWER and (not _WORD.search(n) or re.fullmatch(r"[A-Za-z]{1,30}", n))


def _last_phrase(text, fallback):
    m = None
    for m in _PHRASE.finditer(text):
        pass
    if m is None:
        return None
    tail = text[m.end():m.end() + 300]
    span = _SPAN.match(tail)
    answer = next(g for g in span.groups() if g) if span else _SENTENCE_END.split(tail, 1)[0]
    if not _mathlike(answer):  # "Final Answer: Jane started growing Sphere 3 hours ago."
        numbers = _NUMBER.findall(answer) if fallback else []
        answer = numbers[-1] if numbers else None
    return (m.start(), answer) if answer else None


def extract_answer(text: str, last_number_fallback: bool = False) -> str | None:
    """The final answer in a completion, or None if there is none."""
    text = str(text)[-MAX_TEXT:]
    hashes = list(_HASHES.finditer(text))
    found = [_last_boxed(text), _last_phrase(text, last_number_fallback),
             (hashes[-1].start(), hashes[-1].group(1)) if hashes else None]
    found = [f[:2] for f in found if f and f[1].strip()]
    if found:
        return max(found)[1].strip()
    if not last_number_fallback:
        return None
    text = text[-4000:]  # the span regex is bounded but not linear
    span, numbers = _last_span(text), list(_NUMBER.finditer(text))
    if span and not (numbers and numbers[-1].start() > span[2]):  # "$\Delta x$ ... by 100%"
        return span[1].strip() or None
    if not span and (text.count("$") >= 2 or "\\(" in text or "\\[" in text):
        return None  # LaTeX opened but never closed: do not guess a number from inside it
    if len(text) <= 100 and _mathlike(text):
        return text.strip()
    return numbers[-1].group().rstrip(",") if numbers else None


def _gold_answer(gold) -> str:
    gold = str(gold)
    span = None if "$" not in gold and "\\(" not in gold and "\\[" not in gold else _last_span(gold)
    return extract_answer(gold) or (span[1] if span else gold)


# ------------------------------------------------------------------------------- normalisation
_UNICODE = str.maketrans({"−": "-", "×": "*", "·": "*", "÷": "/", "≤": "\\le ", "≥": "\\ge ",
                          "≠": "\\ne ", "π": "\\pi ", "∞": "\\infty ", "√": "\\sqrt", "∪": "\\cup ",
                          "°": "", "\t": " ", "\n": " "})
_UNWRAP = r"\\(?:text\w*|mbox|math\w+|operatorname|boxed|fbox)\s*\{([^{}]*)\}"
_RULES = [(re.compile(p), r) for p, r in [
    (r"\\[dtc]frac", r"\\frac"), (r"\\[dt]binom", r"\\binom"),
    (r",\\!\s*|\{,\}", ","),  # 10,\!080 and 10{,}080 are thousands separators
    (r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])\.?", ""),
    (r"(?<!\\)\\[,;:! ]|\\q?quad|\\displaystyle|~", " "),
    (_UNWRAP, r"\1"), (_UNWRAP, r"\1"),  # twice: \text{\textbf{..}} nests
    (r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree", ""),
    (r"\\?%|\\?\$|[€£¥]", ""),
    (r"\\begin\{[pbvBV]?matrix\}", r" \\matbegin "), (r"\\end\{[pbvBV]?matrix\}", r" \\matend "),
    (r"^\s*[A-Za-z]\s*\\in\s*", ""),  # "x \in [0, 1)" is the interval
    (r",?\s*\b(?:and|or)\b\s*", ","),  # "19, 46, and 82", "(1,2) or (2,1)"
    (r"(?<=[\d}).])(?:\s*[A-Za-z]{2,}\b(?:\^\{?\d\}?)?)+\s*$", ""),  # units: "5 cm^2", "28 pct"
    (r"(?<![\d.^_{}A-Za-z\\])(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}", r"(\1+\\frac{\2}{\3})"),  # 1\frac45
    (r";", ","), (r",\s*,", ","),
    (r"^[A-Za-z](?:_\{?\w{1,5}\}?)?\s*=\s*(?=[-\d.,/ ]+$)", ""),  # "x = 5" -> "5"; equations stay
]]
_THOUSANDS = re.compile(r"(?<![\d.,(\[])\d{1,3}(?:,\d{3})+(?=$|[^\d,)\]])")
_PLAIN = re.compile(r"-?(?:\d{1,40}(?:\.\d{1,40})?|\.\d{1,40})(?:/\d{1,40})?")


def _normalize(s: str) -> str:
    """String clean-up shared by prediction and gold; regexes without nested repeats, bounded text."""
    s = str(s)[:MAX_TEXT].translate(_UNICODE)
    if len(s) > 4 * MAX_ANSWER:
        return s  # too long to be an answer; the parser refuses it
    if "matrix" not in s and "&" not in s:
        s = s.replace("\\\\", "\\")  # text escaped twice: \\frac -> \frac
    for pattern, repl in _RULES:
        s = pattern.sub(repl, s)
    s = s.strip().lstrip(",;:").rstrip(" .,;:")  # keep the dot of ".4"
    if re.fullmatch(r"\d{1,3}(?: \d{3})+", s):  # 1 000 000
        s = s.replace(" ", "")
    if re.fullmatch(r"-?\d+,\d\d", s):  # decimal comma: 2,74
        s = s.replace(",", ".")
    s = _THOUSANDS.sub(lambda m: m.group().replace(",", ""), s)
    if m := re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}", s):  # keep it on the fast path
        s = f"{m[1]}{m[2]}/{m[3]}"
    if re.fullmatch(r"\{[^{}]*\}|\([A-Za-z]\)", s):
        s = s[1:-1]  # "{1, 2, 3}"; multiple choice "(C)"
    return s.strip()


def _canon(s):
    """Key for string equality: spaces only between two letters; words ignore case."""
    s = re.sub(r"\s(?![A-Za-z])|(?<![A-Za-z])\s", "", re.sub(r"\s+", " ", s))
    return s.lower() if re.fullmatch(r"[A-Za-z][A-Za-z ]*", s) else s


def _quick_equal(pred, gold, rel_tol):
    """True/False when decidable in-process without sympy; None means "ask a worker"."""
    if not pred:
        return False
    if _canon(pred) == _canon(gold):
        return True
    if not (_PLAIN.fullmatch(pred) and _PLAIN.fullmatch(gold)):
        return None
    (a, _, da), (b, _, db) = pred.partition("/"), gold.partition("/")
    if int(da or 1) == 0 or int(db or 1) == 0:
        return None
    a, b = Fraction(a) / int(da or 1), Fraction(b) / int(db or 1)
    if "." in pred + gold:  # a decimal is an approximation, as Floats are in the worker
        return abs(a - b) <= rel_tol * max(abs(a), abs(b))
    return a == b


# ------------------------------------------------------------------------------------ parser
class _Refused(ValueError):
    """Input the parser will not handle: malformed, too big, or too costly to evaluate."""


@dataclass(frozen=True)
class _Rel:
    parts: tuple  # a < b <= c  ->  parts (a, b, c), ops ("<", "<=")
    ops: tuple


_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?|\.\d+)|(\\[A-Za-z]+|\\[{}|]|\\\\)|_\{([^{}]{0,40})\}"
                    r"|_([A-Za-z0-9])|([A-Za-z]+)|(<=|>=|!=|[-+*/^!(),\[\]{}=<>|&]))")
_KINDS = ("num", "cmd", "sub", "sub", "word", "op")
_RELOPS = {"=": "=", "<": "<", ">": ">", "<=": "<=", ">=": ">=", "!=": "!=", "\\le": "<=",
           "\\leq": "<=", "\\leqslant": "<=", "\\ge": ">=", "\\geq": ">=", "\\geqslant": ">=",
           "\\lt": "<", "\\gt": ">", "\\ne": "!=", "\\neq": "!="}
_FUNCS = {"sin": "sin", "cos": "cos", "tan": "tan", "sec": "sec", "csc": "csc", "cot": "cot",
          "arcsin": "asin", "arccos": "acos", "arctan": "atan", "ln": "log", "log": "log", "exp": "exp"}
_STARTS_ATOM = {"(", "{", "\\{", "\\frac", "\\sqrt", "\\pi", "\\infty", "\\matbegin", "\\binom",
                "\\sum"} | {"\\" + f for f in _FUNCS}


def _tokenize(s):
    depth = 0
    for ch in s:  # refuse deep nesting before any recursion happens
        depth += (ch in "([{") - (ch in ")]}")
        if depth > MAX_DEPTH:
            raise _Refused("nesting")
    tokens, pos, s = [], 0, s.rstrip()
    while pos < len(s):
        if not (m := _TOKEN.match(s, pos)):
            raise _Refused(f"unexpected {s[pos:pos + 10]!r}")
        tokens.append((_KINDS[m.lastindex - 1], m.group(m.lastindex)))
        pos = m.end()
    return tokens


def _pow(base, exp):
    if exp.is_Number and abs(exp) > 10_000 and base not in (0, 1, -1):
        raise _Refused("exponent")
    bits = max(abs(base.p), abs(base.q), 2).bit_length() if base.is_Rational else 0
    if exp.is_Number and abs(float(exp)) * bits > MAX_BITS:  # size of the integer sympy would build
        raise _Refused("power")
    return sympy.Pow(base, exp)


def _small_int(n):
    """Argument of a factorial or binomial: a small integer, or symbolic."""
    if n.is_number and not (n.is_Integer and 0 <= n <= MAX_FACTORIAL):
        raise _Refused("factorial")
    return n


class _Parser:
    """Recursive descent over tokens; every node is built by a sympy constructor, never eval."""

    def __init__(self, s):
        if len(s) > MAX_ANSWER:
            raise _Refused("length")
        self.toks, self.i, self.depth = _tokenize(s), 0, 0

    def parse(self):
        items = self._list()
        if self.i != len(self.toks):
            raise _Refused(f"trailing {self._peek()!r}")
        return items[0] if len(items) == 1 else items

    def _peek(self):
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def _next(self):
        if self.i >= len(self.toks):
            raise _Refused("unexpected end")
        self.i += 1
        return self.toks[self.i - 1][1]

    def _accept(self, text):
        """Consume the next token if it is `text`."""
        if self._peek() == text:
            self.i += 1
            return True
        return False

    def _expect(self, text):
        if not self._accept(text):
            raise _Refused(f"expected {text}")

    def _list(self):  # a, b, c
        items = [self._item()]
        while self._accept(","):
            items.append(self._item())
        return items

    def _item(self):  # A \cup B
        value = self._relation()
        while self._accept("\\cup"):
            value = sympy.Union(_as_set(value), _as_set(self._relation()))
        return value

    def _relation(self):  # a < b <= c, x = y
        parts, ops = [self._expr()], []
        while self._peek() in _RELOPS:
            ops.append(_RELOPS[self._next()])
            parts.append(self._expr())
        if ops and set(ops) == {"="} and len(parts) > 2:
            parts, ops = [parts[0], parts[-1]], ["="]  # x = 5+5+1 = 11: the last value counts
        return _Rel(tuple(parts), tuple(ops)) if ops else parts[0]

    def _expr(self):
        value = self._term()
        while self._peek() in ("+", "-"):
            value = value + self._term() if self._next() == "+" else value - self._term()
        return value

    def _term(self):
        value = self._unary()
        while True:
            t = self._peek()
            if t in ("*", "\\cdot", "\\times"):
                self._next()
                value = value * self._unary()
            elif t in ("/", "\\div"):
                self._next()
                value = value / self._unary()
            elif t in _STARTS_ATOM or (t and self.toks[self.i][0] in ("num", "word")):
                value = value * self._power()  # implicit product: 2\pi r, (a+5)(b+2)
            else:
                return value

    def _unary(self):
        negative = False
        while self._peek() in ("-", "+"):  # a loop, not recursion: "- - - 1" has no depth
            negative ^= self._next() == "-"
        value = self._power()
        return -value if negative else value

    def _power(self):
        value = self._atom()
        while self._accept("!"):
            value = sympy.factorial(_small_int(value))
        return _pow(value, self._unary()) if self._accept("^") else value

    def _arg(self):
        """A macro argument: {group}, or one character as in \\frac12 or \\sqrt2."""
        kind, text = self.toks[self.i] if self.i < len(self.toks) else (None, None)
        if kind == "num" and len(text) > 1:
            self.toks[self.i] = (kind, text[1:])
            return sympy.Integer(int(text[0]))
        return self._atom()

    def _atom(self):
        self.depth += 1  # every nested bracket, argument or exponent passes through here
        try:
            if self.depth > MAX_DEPTH:
                raise _Refused("depth")
            kind, t = self.toks[self.i] if self.i < len(self.toks) else (None, None)
            self._next()
            sub = self._next() if self.i < len(self.toks) and self.toks[self.i][0] == "sub" else None
            return self._atom_body(kind, t, sub)
        finally:
            self.depth -= 1

    def _atom_body(self, kind, t, sub):
        if kind == "num":
            if len(t) > MAX_DIGITS:
                raise _Refused("digits")
            if sub:  # 52_8 is a numeral in base 8: an opaque name
                return sympy.Symbol(f"{t}_{sub}")
            return sympy.Float(t, max(15, len(t))) if "." in t else sympy.Integer(int(t))
        if kind == "word":  # "xy" is x*y; a longer word ("even", "Evelyn") is one name
            names = [t] if len(t) >= 3 else list(t)
            names[-1] += f"_{sub}" if sub else ""
            special = {"i": sympy.I, "e": sympy.E, "pi": sympy.pi}
            return sympy.pi if t == "pi" else sympy.Mul(*[special.get(n) or sympy.Symbol(n) for n in names])
        if t in ("(", "["):
            items, close = self._list(), self._next()
            if close not in (")", "]"):
                raise _Refused("bracket")
            if len(items) == 1 and t + close in ("()", "[]"):
                return items[0]
            if t + close == "()":
                return tuple(items)
            if len(items) != 2:
                raise _Refused("interval")
            return sympy.Interval(items[0], items[1], t == "(", close == ")")
        if t in ("{", "\\{"):  # {group}; \{a, b\} is a set, kept as a list
            items = self._list()
            self._expect("}" if t == "{" else "\\}")
            return list(items) if t == "\\{" or len(items) > 1 else items[0]
        if t == "|":
            value = self._expr()
            self._expect("|")
            return sympy.Abs(value)
        if kind != "cmd":
            raise _Refused(f"unexpected {t}")
        constants = {"\\pi": sympy.pi, "\\infty": sympy.oo, "\\emptyset": sympy.S.EmptySet}
        if t in constants:
            return constants[t]
        if t == "\\frac":
            return self._arg() / self._arg()
        if t == "\\binom":
            return sympy.binomial(_small_int(self._arg()), self._arg())
        if t == "\\sqrt":  # \sqrt{x}, \sqrt[3]{x}
            if not self._accept("["):
                return sympy.sqrt(self._arg())
            index = self._expr()
            self._expect("]")
            return sympy.root(self._arg(), index)
        if t == "\\matbegin":
            rows, row = [], [self._item()]
            while self._peek() in ("&", "\\\\"):
                if self._next() == "&":
                    row.append(self._item())
                else:
                    rows.append(row)
                    row = [self._item()] if self._peek() != "\\matend" else []
            self._expect("\\matend")
            return sympy.ImmutableMatrix(rows + [row] if row else rows)
        if t == "\\sum" and sub and "=" in sub:  # \sum_{k=0}^{n-1} term
            var, low = sub.split("=", 1)
            self._expect("^")
            high = self._arg()
            return sympy.Sum(self._term(), (sympy.Symbol(var.strip()), _Parser(low).parse(), high))
        if t and t[1:] in _FUNCS:
            power = self._arg() if self._accept("^") else None  # \sin^2 x
            arg = self._atom() if self._peek() == "(" else self._power()
            f = getattr(sympy, _FUNCS[t[1:]])
            value = f(arg, _Parser(sub).parse()) if t == "\\log" and sub else f(arg)
            return value if power is None else _pow(value, power)
        raise _Refused(f"unknown {t}")


def _parse_answer(s):
    """Normalised answer -> sympy object, tuple, list (unordered) or _Rel."""
    global sympy
    import sympy
    if "\\approx" in s:  # "x \approx 11" -> 11, "1/3 \approx 0.33" -> 1/3
        pieces = [p for p in s.split("\\approx") if p.strip()]
        s = pieces[-1] if re.fullmatch(r"\s*[A-Za-z]\s*", pieces[0]) else pieces[0]
    pieces = re.split(r"\\pm|\\mp", s)
    if len(pieces) > 4:
        raise _Refused("too many \\pm")
    if len(pieces) == 1:
        return _Parser(s).parse()
    values = []  # 1 \pm \sqrt{19} is the list of both values
    for signs in itertools.product("+-", repeat=len(pieces) - 1):
        value = _Parser(pieces[0] + "".join(map("".join, zip(signs, pieces[1:])))).parse()
        values.extend(value if isinstance(value, list) else [value])
    return values


# -------------------------------------------------------------------------------- comparison
def _numeric_close(a, b, tol):
    """True/False from values at two sample points; None if they cannot be computed."""
    syms = sorted(a.free_symbols | b.free_symbols, key=str)
    if len(syms) > 20:
        return None
    try:
        for k in (1, 2):  # distinct, irrational-looking values in (0.25, 1.25) for every symbol
            subs = {x: 0.25 + ((i + 1) * (0.7548776662 + 0.3141592 * k)) % 1 for i, x in enumerate(syms)}
            x, y = a.evalf(30, subs=subs), b.evalf(30, subs=subs)
            if not (x.is_number and y.is_number and x.is_finite and y.is_finite):
                return None  # compare sympy Floats: 1e1989 must not overflow to inf == inf
            if not bool(abs(x - y) <= tol * max(abs(x), abs(y)) + 1e-15):
                return False
        return True
    except (TypeError, ValueError, ArithmeticError):
        return None


def _same_expr(a, b, tol):
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
        return a == b
    if a == b:
        return True
    if a.has(sympy.nan, sympy.zoo) or b.has(sympy.nan, sympy.zoo) or (a.is_Rational and b.is_Rational):
        return False  # 1/0; or exact numbers that differ (no tolerance for 1000000 vs 1000001)
    close = _numeric_close(a, b, tol)
    return close if close is not None else sympy.simplify(a - b) == 0


def _as_set(x):
    if isinstance(x, tuple) and len(x) == 2:
        return sympy.Interval.open(*x)  # (a, b) is a point or an open interval; here the interval
    if isinstance(x, (list, sympy.Expr)):
        return sympy.FiniteSet(*(x if isinstance(x, list) else [x]))
    return _rel_to_set(x) if isinstance(x, _Rel) else x


def _oriented(r):
    """a > b >= c  ->  c <= b < a, so that equal relations have equal parts and ops."""
    if r.ops and all(op in (">", ">=") for op in r.ops):
        return _Rel(r.parts[::-1], tuple(op.replace(">", "<") for op in r.ops[::-1]))
    return r


def _rel_to_set(r):
    r = _oriented(r)
    if not all(op in ("<", "<=") for op in r.ops):
        raise _Refused("not an inequality")
    syms = set().union(*(p.free_symbols for p in r.parts))
    if len(r.parts) == 3 and (len(syms) != 1 or r.parts[1].is_Symbol):  # 0 < f(x) < 1
        return sympy.Interval(r.parts[0], r.parts[2], r.ops[0] == "<", r.ops[1] == "<")
    if len(syms) != 1:
        raise _Refused("not one variable")
    x, result = syms.pop(), sympy.S.Reals
    for low, op, high in zip(r.parts, r.ops, r.parts[1:]):  # 1 <= |z| <= 3/2 needs solving
        rel = sympy.Lt(low, high) if op == "<" else sympy.Le(low, high)
        result = result.intersect(sympy.solveset(rel, x, sympy.S.Reals))
    return result


def _is_name(e):
    """x, f(x), |AB|, (p, q): the left side of an equation that only names the answer."""
    if isinstance(e, tuple):
        return all(_is_name(x) for x in e)
    return isinstance(e, sympy.Expr) and bool(e.free_symbols) and not e.atoms(sympy.Number)


def _same_rel(a, b, tol):
    if isinstance(a, _Rel) and isinstance(b, _Rel):
        if a.ops == b.ops == ("=",):
            (l1, r1), (l2, r2) = a.parts, b.parts
            if (_same(l1, l2, tol) and _same(r1, r2, tol)) or (_same(l1, r2, tol) and _same(r1, l2, tol)):
                return True
            if not all(isinstance(p, sympy.Expr) for p in a.parts + b.parts):
                return False
            ratio = sympy.simplify((l1 - r1) / (l2 - r2))  # 2x+4y-3=0 is y=-x/2+3/4
            return bool(ratio.is_number and ratio.is_finite and ratio != 0)
        a, b = _oriented(a), _oriented(b)
        return a.ops == b.ops and all(_same(x, y, tol) for x, y in zip(a.parts, b.parts))
    r, other = (a, b) if isinstance(a, _Rel) else (b, a)
    if r.ops == ("=",) and _is_name(r.parts[0]):
        return _same(r.parts[1], other, tol)
    return isinstance(other, (tuple, sympy.Set)) and _same(_rel_to_set(r), other, tol)


def _same(a, b, tol):
    """Equality of parsed answers, recursing through their structure."""
    if isinstance(a, _Rel) or isinstance(b, _Rel):
        return _same_rel(a, b, tol)
    if isinstance(a, list) or isinstance(b, list):
        xs, ys = [list(v) if isinstance(v, (list, tuple)) else [v] for v in (a, b)]
        if isinstance(a, tuple) or isinstance(b, tuple):  # a tuple fixes the order
            return len(xs) == len(ys) and all(_same(x, y, tol) for x, y in zip(xs, ys))
        return (all(any(_same(x, y, tol) for y in ys) for x in xs)
                and all(any(_same(x, y, tol) for x in xs) for y in ys))
    if isinstance(a, sympy.Set) or isinstance(b, sympy.Set):
        a, b = _as_set(a), _as_set(b)
        if isinstance(a, sympy.Interval) and isinstance(b, sympy.Interval):
            return (a.left_open, a.right_open) == (b.left_open, b.right_open) and \
                _same_expr(a.start, b.start, tol) and _same_expr(a.end, b.end, tol)
        if type(a) is type(b) and isinstance(a, (sympy.Union, sympy.FiniteSet)):
            return _same(list(a.args), list(b.args), tol)
        return a == b
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and \
            all(_same(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, sympy.MatrixBase) or isinstance(b, sympy.MatrixBase):
        return isinstance(a, sympy.MatrixBase) and isinstance(b, sympy.MatrixBase) and \
            a.shape == b.shape and all(_same_expr(x, y, tol) for x, y in zip(a, b))
    return _same_expr(a, b, tol)


def _equivalent(pred: str, gold: str, rel_tol: float) -> bool:
    """Parse and compare two normalised answers. May be slow: only call it in a worker."""
    try:
        a, b = _parse_answer(pred), _parse_answer(gold)
        return bool(_same(a, b, rel_tol))
    except Exception:  # noqa: BLE001 -- refused input or any sympy error means "not equal"
        return False


# ------------------------------------------------------------------------------ worker pool
class _Pool:
    """Persistent worker processes with a hard deadline per job: a worker past it is killed,
    reaped and replaced. Protocol: "ready" once, then one JSON job in and one "1"/"0" out; a
    worker never has two messages in flight, and each is a single atomic pipe write."""

    def __init__(self, n):
        self.procs = [self._spawn() for _ in range(n)]
        self.ready = set()  # pids that have imported sympy

    def _spawn(self):
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, bufsize=0)

    def _replace(self, p):
        p.kill()
        p.wait()  # reap it: no zombies
        self.ready.discard(p.pid)
        self.procs[self.procs.index(p)] = self._spawn()

    def run(self, jobs, timeout):
        """Verdict per job: True/False, or None if it timed out or its worker died."""
        results, todo, busy, started = [None] * len(jobs), list(range(len(jobs)))[::-1], {}, time.monotonic()
        while todo or busy:
            for p in list(self.procs):
                if todo and p.pid in self.ready and p not in busy:
                    i = todo.pop()
                    try:
                        p.stdin.write((json.dumps(jobs[i]) + "\n").encode())
                        busy[p] = (i, time.monotonic() + timeout)
                    except OSError:  # it died while idle
                        todo.append(i)
                        self._replace(p)
            if not busy and not self.ready and time.monotonic() - started > 60:
                break  # workers cannot start at all: the remaining jobs stay None
            waiting = {p.stdout: p for p in self.procs if p in busy or p.pid not in self.ready}
            until = min((d for _, d in busy.values()), default=time.monotonic() + 1)
            for f in select.select(list(waiting), [], [], max(0.0, until - time.monotonic()))[0]:
                p, line = waiting[f], os.read(f.fileno(), 64)
                if line.startswith(b"ready"):
                    self.ready.add(p.pid)
                elif line and p in busy:
                    results[busy.pop(p)[0]] = line.startswith(b"1")
                else:  # EOF: the worker crashed (for example at its memory cap)
                    busy.pop(p, None)
                    self._replace(p)
            for p, (i, deadline) in list(busy.items()):
                if time.monotonic() > deadline:
                    del busy[p]
                    self._replace(p)
        return results

    def close(self):
        for p in self.procs:
            try:
                p.stdin.close()  # a worker exits at EOF
                p.wait(timeout=1)
            except (OSError, subprocess.TimeoutExpired):
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
        return _pool.run(jobs, cfg.timeout)


def _serve():
    """Worker loop (python rewards.py --worker)."""
    import resource
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway job dies, not the host
    _equivalent("1 \\le |x| \\le 2", "[-2, -1] \\cup [1, 2]", 1e-6)  # import sympy, solveset and
    sympy.simplify(sympy.sin(sympy.Symbol("x")) ** 2 - 1)  # simplify's lazy imports before any deadline
    os.write(1, b"ready\n")  # one write per message: the parent's single os.read sees it whole
    for line in sys.stdin:
        os.write(1, b"1\n" if _equivalent(*json.loads(line)) else b"0\n")


# -------------------------------------------------------------------------------- public API
@lru_cache(maxsize=4096)
def _gold_normalized(gold: str) -> str:
    return _normalize(_gold_answer(gold))  # the G completions of a group share one gold


def score_batch(completions: list[str], golds: list, cfg: RewardConfig) -> tuple[list[float], list[bool], dict]:
    """Rewards, correctness and metrics for a batch; plain numbers never leave this process."""
    t0 = time.perf_counter()
    answers = [extract_answer(c, cfg.last_number_fallback) for c in completions]
    correct, jobs, where = [False] * len(answers), [], []
    for i, (answer, gold) in enumerate(zip(answers, golds)):
        if answer is not None:
            pred, gold = _normalize(answer), _gold_normalized(str(gold))
            correct[i] = _quick_equal(pred, gold, cfg.rel_tol)
            if correct[i] is None:
                jobs.append((pred, gold, cfg.rel_tol))
                where.append(i)
    try:
        results = _run_jobs(jobs, cfg) if jobs else []
    except OSError:  # workers could not be started: everything sent counts as a timeout
        results = [None] * len(jobs)
    for i, result in zip(where, results):
        correct[i] = bool(result)
    rewards = [(cfg.no_answer if a is None else cfg.correct if ok else cfg.wrong)
               + (cfg.format_bonus if _BOX.search(str(c)[-MAX_TEXT:]) else 0.0)
               for a, ok, c in zip(answers, correct, completions)]
    n = max(1, len(answers))
    return rewards, correct, {"reward/timeouts": sum(r is None for r in results),
                              "reward/no_answer_frac": sum(a is None for a in answers) / n,
                              "reward/correct_frac": sum(correct) / n,
                              "reward/worker_frac": len(jobs) / n,
                              "reward/verify_seconds": time.perf_counter() - t0}


def overlong_penalty(lengths, max_new_tokens: int, cfg: RewardConfig):
    """DAPO's soft overlong punishment for completion lengths (a tensor), added to the reward: 0 up to max_new_tokens
    − overlong_buffer tokens, then falling linearly to −overlong_factor at max_new_tokens; 0 when the buffer is 0."""
    if cfg.overlong_buffer <= 0:
        return 0.0 * lengths
    return -cfg.overlong_factor * (lengths - (max_new_tokens - cfg.overlong_buffer)).clamp(min=0) / cfg.overlong_buffer


def verify(completion: str, gold: str, rel_tol: float = 1e-6, timeout: float = 2.0,
           last_number_fallback: bool = False) -> bool:
    """Is the completion's final answer equal to the gold answer? Never raises."""
    cfg = RewardConfig(rel_tol=rel_tol, timeout=timeout, last_number_fallback=last_number_fallback)
    try:
        return score_batch([completion], [gold], cfg)[1][0]
    except Exception:  # noqa: BLE001 -- the contract is to never raise
        return False


def math_reward(completion: str, gold: str, cfg: RewardConfig) -> float:
    """The scalar reward GRPO optimises; evaluation reads the same verdicts from score_batch."""
    return score_batch([completion], [gold], cfg)[0][0]


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _serve()
