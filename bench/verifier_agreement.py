"""Agreement of rewards.py with math-verify on labelled (gold, prediction) cases, both called the
same way.

Usage:
  pip install -r bench/requirements.txt          # math-verify
  python bench/verifier_agreement.py  # answer-form cases of tests/test_rewards.py, then the dev set

rewards.py is called as its tests call it: verify(pred, gold, rel_tol=10**-digits,
last_number_fallback=True).
math-verify is called as its own test suite calls it: parse() with LaTeX (boxed first) and
plain-expression extraction on both sides, then verify(gold, pred, float_rounding=digits) with the
case's set/relation option.
Every disagreement is printed; in tests/test_rewards.py each deliberate one carries a comment saying
why.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import rewards
from bench import cli


def math_verify(gold, pred, digits, set_relation):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    targets = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return bool(verify(parse(gold, targets), parse(pred, targets), float_rounding=digits,
                       allow_set_relation_comp=set_relation))


def report(name, cases):
    """cases: (group, gold, pred, digits, set_relation); prints disagreements and the agreement per
    group."""
    groups = {}
    for group, gold, pred, digits, set_relation in cases:
        ours = rewards.verify(pred, gold, rel_tol=10.0 ** -digits, last_number_fallback=True)
        theirs = math_verify(gold, pred, digits, set_relation)
        groups.setdefault(group, []).append(ours == theirs)
        if ours != theirs:
            print(f"  differ ({group}): rewards.py {ours}, math-verify {theirs}: "
                  f"gold {gold!r}, pred {pred!r}")
    total = [ok for oks in groups.values() for ok in oks]
    print(f"{name}: {sum(total)}/{len(total)} = {sum(total) / len(total):.1%} agree")
    for group, oks in groups.items():
        print(f"  {group:32s} {sum(oks):3d}/{len(oks)}")


def main():
    ap = cli.Parser(__file__, __doc__)
    ap.parse_args()
    ap.need("math_verify")
    import logging
    logging.disable(logging.WARNING)  # math-verify warns on every timeout-free call
    from test_rewards import KINDS
    report("answer forms (tests/test_rewards.py)",
           [(kind, gold, pred, 6, False)
            for kind, cases in KINDS.items() for gold, pred, _ in cases])
    data = (Path(os.environ.get("SHARED_DATA_DIR", ROOT.parent / "shared" / "data"))
            / "verifier" / "mathverify_cases.jsonl")
    if data.exists():
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        report("math-verify's own test cases (the shared dev set), math-verify called live",
               [("dev", r["gold"], r["pred"], r["float_rounding"], r["set_relation"])
                for r in rows])


if __name__ == "__main__":
    main()
