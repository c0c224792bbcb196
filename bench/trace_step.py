"""Which of the repository's modules one ordinary training step runs: the claims that support/ is
what a reader of GRPO may skip, and that a method that is off is not in the step, measured.

  python bench/trace_step.py                          # the default run, configs/tiny.yaml
  python bench/trace_step.py --config configs/tiny/aper.yaml
  python bench/trace_step.py -- --replay.strategy=uniform   # overrides after --

It runs train.py's main in this process on the config for 3 steps (evals at step 0 and the end
only, no checkpoint: eval.every=0, checkpoint.every=0) and records, with sys.setprofile, every
Python function of the repository entered from the moment step 2's rollout starts until step 3's
does: one step that is neither the first, nor an eval's, nor a checkpoint's. It prints each module
entered with the functions, support/ modules first, and exits 1 when more support/ modules than
--max ran, or more functions of methods/ than --max-methods (default 0: configs/tiny.yaml has
every method off).
"""

from __future__ import annotations

import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import cli

SHORT = ["--max_steps=3", "--eval.every=0", "--eval.n=16", "--checkpoint.every=0",
         "--wandb.mode=disabled", "--threads=1"]


class StepTrace:
    """A profile function: the repository's functions entered during the step `step` (0-based),
    from the call of train.one_round for it (the step's first rollout round) to the call for the
    next step."""

    def __init__(self, step: int):
        self.step = step
        self.inside = False
        self.entered = defaultdict(set)  # module path -> names of the functions entered

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        path = Path(code.co_filename)
        if code.co_name == "one_round" and path.name == "train.py":
            self.inside = frame.f_locals.get("step") == self.step
        if self.inside and path.is_relative_to(REPO):
            self.entered[str(path.relative_to(REPO))].add(code.co_qualname)


def trace(config: str, overrides: list[str], step: int = 1) -> dict[str, set]:
    """{module: functions} that step `step` of a short run on `config` entered."""
    import train

    tracer = StepTrace(step)
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--config", config, *SHORT, f"--out_dir={tmp}/run", *overrides]
        sys.setprofile(tracer)
        try:
            code = train.main(argv)
        finally:
            sys.setprofile(None)
    if code != 0:
        raise SystemExit(f"train.py exited {code}")
    return dict(tracer.entered)


def support_modules(entered: dict[str, set]) -> list[str]:
    return sorted(m for m in entered if m.startswith("support/"))


def methods_entered(entered: dict[str, set]) -> int:
    """Functions of methods/ entered."""
    return sum(len(f) for m, f in entered.items() if m.startswith("methods/"))


def main() -> None:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--max", type=cli.count, default=4, help="support/ modules allowed in one step")
    ap.add_argument("--max-methods", type=cli.count, default=0,
                    help="functions of methods/ allowed in one step")
    ap.add_argument("overrides", nargs="*", help="config overrides for train.py (after --)")
    a = ap.parse_args()
    config = str(REPO / a.config)  # (from any folder, as the other bench scripts)
    ap.check_config(config, [*SHORT, *a.overrides])
    entered = trace(config, a.overrides)
    support = support_modules(entered)
    others = sorted(m for m in entered if m not in support)
    for module in support + others:
        print(f"{module:28s} {', '.join(sorted(entered[module]))}")
    print(f"\nsupport/ modules in one ordinary step: {len(support)} (at most {a.max})")
    methods = methods_entered(entered)
    print(f"functions of methods/ entered: {methods} (at most {a.max_methods})")
    if len(support) > a.max or methods > a.max_methods:
        sys.exit(1)


if __name__ == "__main__":
    main()
