"""Reproduce the replay claims at tiny scale: every config of a folder × 10 seeds on the embedded
task, then the comparison tables (eval.py --compare, the area to the shortest finished run's tokens)
in <out>/compare/<metric>/ (accuracy, pass_at_k, maj_at_k, greedy; with a tuned --baseline, against
`none` too in compare/vs_none/) and accuracy's plots (compare.png; cost.png, the GPU-time model).
Runs continued past their end in <out>_long/ (same names: #60's rule) give the final value's
crossings (eval.py --compare --continued);
--continue-to STEPS makes them: each run of every arm whose seed-mean final avg@k is below the tuned
baseline's, and every other run (the baseline's own too) that has not held that final by its end
(on the evals every run shares; the arms must share max_steps and eval.every), is copied there and
resumed to STEPS (made again from step 0 if it kept no checkpoint).

Usage:
  python bench/reproduce_tiny.py                                      # configs/tiny/* -> runs/repro
  python bench/reproduce_tiny.py --configs configs/tiny_half --out runs/repro_half
  python bench/reproduce_tiny.py --names none aper --seeds 0 1 --jobs 2
  python bench/reproduce_tiny.py --configs configs/fair --out runs/fair \
      --baseline none,none_lr0.5x,none_lr0.75x,none_lr1.5x,none_lr2x --continue-to 300  # #60

Every `<configs>/<name>.yaml` but common.yaml is one arm (configs/tiny/: one per replay strategy in
replay.STRATEGIES, plus dynamic.yaml, DAPO's dynamic sampling). The arms share their fresh rollouts
per step and their steps, so the same generation budget; dynamic sampling's extra rounds and RLEP's
phase I are generated tokens too and are counted in `tokens/generated_total`.

Order: `none`'s first seed goes first; RLEP's phase I then samples 8 answers per training problem
from its final model and keeps the verified-correct ones with their token ids and
behaviour log-probs (as RLEP collects them from a finished run; eval.py --save-correct, whose
.meta.json gives the tokens phase I generated); then every arm seed by seed (seed 0 of each arm,
then seed 1, ...), so a reproduction stopped part-way has as many seeds of every arm. A run
already finished (summary.json present) is kept, so an interrupted reproduction can simply be
started again; an unfinished one resumes from its newest checkpoint (--resume: bit-identical to
an uninterrupted run), or is started over (--overwrite) if it saved none. The tables and the plot
are the reproduction's own: a reproduction started again replaces them.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LONG = "_long"  # <out>_long/: the runs continued past their end, each named as its run
sys.path.insert(0, str(REPO))
from analysis.area import common_grid, tuned
from analysis.compare import sustained_crossing
from analysis.compare_io import load_run
from analysis.evals import METRICS
from analysis.stats import mean
from bench import cli
from config import load_config
from replay import STRATEGIES


def arms(folder: Path) -> list[str]:
    """The configs in `folder`: none first, then the strategies in registry order, then anything
    else."""
    names = [p.stem for p in folder.glob("*.yaml") if p.stem != "common"]
    rank = {s: i for i, s in enumerate(["none", "dynamic", *STRATEGIES])}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def default_out(configs: Path) -> str:
    """runs/repro for configs/tiny, runs/repro_<suffix> for configs/tiny_<suffix>, and
    runs/repro_<folder> for any other folder."""
    if configs.name == "tiny":
        return "runs/repro"
    return f"runs/repro_{configs.name.removeprefix('tiny_')}"


def train(configs: Path, name: str, seed: int, out: Path, extra: list[str],
          steps: int | None = None) -> Path:
    """Run `<out>/<name>-s<seed>` of `<configs>/<name>.yaml`: skipped when finished (to `steps`,
    when given: a run continued past its end), resumed from its newest checkpoint, or started over
    (--overwrite) when it saved none."""
    run = out / f"{name}-s{seed}"
    if finished(run, steps):
        print(f"[skip] {run} is finished", flush=True)
        return run
    start = "--overwrite"
    if any(run.glob("checkpoints/step_*")):
        start = "--resume"
        print(f"[resume] {run}", flush=True)
    cmd = [sys.executable, "train.py", "--config", str(configs / f"{name}.yaml"),
           f"--out_dir={run}", f"--seed={seed}",
           start, f"--wandb.name={configs.name}{LONG * bool(steps)}-{name}-s{seed}", *extra]
    if steps:
        cmd.append(f"--max_steps={steps}")
    t0 = time.time()
    with open(out / f"{name}-s{seed}.log", "a") as log:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT)
    print(f"[done] {run} in {time.time() - t0:.0f}s", flush=True)
    return run


def finished(run: Path, steps: int | None) -> bool:
    """Whether `run` wrote its summary.json (of `steps` steps, when given)."""
    summary = run / "summary.json"
    if not summary.exists():
        return False
    if steps is None:
        return True
    return json.loads(summary.read_text()).get("steps", 0) >= steps


def to_continue(out: Path, names: list[str], seeds: list[int], candidates: list[str]) -> tuple:
    """#60's continuation rule: (the tuned baseline, the runs to continue as (arm, seed)). The
    tuned baseline is the arm of `candidates` of highest mean area in avg@k at the shortest
    finished run's tokens (analysis/area.py, as eval.py --compare --baseline chooses). Continued:
    every run of an arm whose seed-mean final avg@k is below the baseline's, and any other run
    whose eval curve does not hold that final by its end (compare.sustained_crossing: the
    baseline's own too), so that the tokens to the final target have an interval."""
    runs = []
    for seed in seeds:
        for name in names:
            runs.append(load_run(out / f"{name}-s{seed}") | {"strategy": name, "seed": seed})
    baseline = tuned(runs, candidates, "shortest")[0]
    finals = {}
    for name in names:
        mine = [run["final"] for run in runs if run["strategy"] == name]
        if None in mine:
            raise ValueError(f"--continue-to: a run of {name} has no eval, so no final value")
        finals[name] = mean(mine)
    target = finals[baseline]
    common_grid(runs)  # (the evals every run shares, as the comparison measures the crossings)
    below = []
    for run in runs:
        short = sustained_crossing(run["curve"], target) is None
        if finals[run["strategy"]] < target or short:
            below.append((run["strategy"], run["seed"]))
    return baseline, below


def continued(configs: Path, name: str, seed: int, out: Path, longer: Path, steps: int,
              extra: list[str]):
    """`<out>/<name>-s<seed>` continued to `steps` in `longer` (#60's rule): a copy of the run
    resumed from its newest checkpoint (a constant learning rate: then it is the run, longer). A
    run that kept no checkpoint is made again there from step 0 (the same run where nothing but
    max_steps differs; eval.py --compare --continued refuses a copy whose first evals differ).
    The checkpoint keeps the run's wandb id, so a copy continues its run's wandb record (online:
    the original's record gets the continued steps; the files on disk are the copy's)."""
    run, copy = out / f"{name}-s{seed}", longer / f"{name}-s{seed}"
    if not copy.exists() and any(run.glob("checkpoints/step_*")):
        partial = copy.with_name(copy.name + ".partial")  # (a copy cut short is never resumed)
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(run, partial)
        partial.rename(copy)
    train(configs, name, seed, longer, extra, steps)


def rlep_phase_one(out: Path, seed: int, config: Path, extra: list[str]) -> Path:
    """RLEP phase I from the final model of `none` seed `seed`: G samples per training problem with
    the rlep arm's own sampling settings (`config` and the overrides); the verified-correct ones are
    kept."""
    phase1 = out / "rlep_phase1.jsonl"
    if not phase1.exists():
        cfg = load_config(str(config), extra)
        r = cfg.rollout
        subprocess.run(
            [sys.executable, "eval.py", "--model", str(out / f"none-s{seed}" / "final"),
             "--k", str(r.group_size), "--temperature", str(r.temperature), "--top-p", str(r.top_p),
             "--top-k", str(r.top_k), "--max-new-tokens", str(r.max_new_tokens),
             "--benchmarks", "tiny_train", "--template", cfg.data.template,
             "--batch-size", "256", "--save-correct", str(phase1),
             "--out-dir", str(out / "rlep_phase1"), "--overwrite"], cwd=REPO, check=True)
    return phase1


def continued_runs(ap, out: Path, names: list[str], seeds: list[int], candidates: list[str],
                   longer: Path) -> list[tuple]:
    """The runs `to_continue` continues, said on a line; exits with one line when the tuned
    baseline cannot be chosen, when a run has no eval (no final value), or when `longer` holds a
    copy of another compared run (the tables would measure it there: the rule continues only
    those runs; copies of runs not compared, another seed's, are not read)."""
    try:
        baseline, below = to_continue(out, names, seeds, candidates)
    except ValueError as e:
        ap.error(str(e))
    said = [f"{name}-s{seed}" for name, seed in below]
    print(f"continued: {', '.join(said) or 'no run'} (of an arm whose seed-mean final avg@k is "
          f"below that of the tuned baseline {baseline}, or not holding it by their end)",
          flush=True)
    for seed in seeds:
        for name in names:
            copy = longer / f"{name}-s{seed}"
            if copy.is_dir() and copy.name not in said:
                ap.error(f"{copy}: a copy of a run the rule does not continue (its arm's "
                         f"seed-mean final avg@k is not below {baseline}'s and it holds it by "
                         f"its end): remove it")
    return below


def main() -> None:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--configs", default="configs/tiny", help="folder with one <name>.yaml per arm")
    ap.add_argument("--out", default=None,
                    help="where the runs go (default: runs/repro for configs/tiny, "
                    "runs/repro_half for configs/tiny_half, runs/repro_fair for configs/fair)")
    ap.add_argument("--names", nargs="+", help="arms to run (default: every config in --configs)")
    ap.add_argument("--seeds", type=cli.count, nargs="+", default=list(range(10)))
    ap.add_argument("--baseline", default="none", help="eval.py --compare's: the arm, or arms "
                    "to tune it over (none,none_lr2x: the one of higher mean area)")
    ap.add_argument("--jobs", type=cli.positive_int, default=2,
                    help="training processes at once (each uses one thread)")
    ap.add_argument("--continue-to", type=cli.positive_int, metavar="STEPS",
                    help="#60's rule: every run of each arm whose seed-mean final avg@k is below "
                    "the tuned baseline's, and any other run not holding it by its end, is "
                    "continued to STEPS in <out>_long/ (the tables measure the baseline's final "
                    "value on them)")
    # anything else is passed to train.py as an override
    a, extra = ap.parse_known_args()
    configs = (REPO / a.configs).resolve()
    available = arms(configs)
    names = a.names or available
    if not names or set(names) - set(available):
        ap.error(f"no {configs}/<name>.yaml for "
                 f"{sorted(set(names) - set(available)) or 'any arm'}; "
                 f"available: {', '.join(available) or 'none'}")
    missing = {"none", *a.baseline.split(",")} - set(names)  # (none's model: RLEP's phase I)
    if missing:
        ap.error(f"the comparison needs its baseline: include {', '.join(sorted(missing))}")
    if len(set(a.seeds)) < len(a.seeds):
        ap.error(f"--seeds names a seed twice: {' '.join(map(str, a.seeds))}")
    ap.check_folder("--out", a.out)
    grids = {}  # (max_steps, eval.every): the arms of each
    for name in names:  # every arm's config with the overrides, before the first run
        cfg = ap.check_config(str(configs / f"{name}.yaml"), extra)
        if a.continue_to and a.continue_to <= cfg.max_steps:
            ap.error(f"--continue-to {a.continue_to}: not past {name}'s {cfg.max_steps} steps")
        grids.setdefault((cfg.max_steps, cfg.eval.every), []).append(name)
    if a.continue_to and len(grids) > 1:  # (the rule's crossings would not be the comparison's)
        said = [f"{', '.join(arms)}: {steps} steps, an eval every {every}"
                for (steps, every), arms in grids.items()]
        ap.error(f"--continue-to: the arms must share max_steps and eval.every ({'; '.join(said)})")
    out = (REPO / (a.out or default_out(configs))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with ThreadPoolExecutor(a.jobs) as pool:
        train(configs, "none", a.seeds[0], out, extra)  # RLEP's phase I samples its final model
        overrides = {name: extra for name in names}
        if "rlep" in names:
            phase1 = rlep_phase_one(out, a.seeds[0], configs / "rlep.yaml", extra)
            overrides["rlep"] = extra + [f"--replay.rlep_source={phase1}"]
        # seed by seed, every arm: a reproduction stopped part-way has a few seeds of every arm
        jobs = [(n, s) for s in a.seeds for n in names if (n, s) != ("none", a.seeds[0])]
        list(pool.map(lambda j: train(configs, j[0], j[1], out, overrides[j[0]]), jobs))
        print(f"all runs finished in {(time.time() - t0) / 60:.1f} min", flush=True)
        longer = out.with_name(out.name + LONG)  # copies run past their end (#60's rule)
        if a.continue_to:
            jobs = continued_runs(ap, out, names, a.seeds, a.baseline.split(","), longer)
            if jobs:
                longer.mkdir(exist_ok=True)
            list(pool.map(lambda j: continued(configs, j[0], j[1], out, longer, a.continue_to,
                                              overrides[j[0]]), jobs))
    runs = [f"{n}={out / f'{n}-s{s}'}" for n in names for s in a.seeds]  # each arm by its name
    compare = [sys.executable, "eval.py", "--compare", *runs, "--budget", "shortest",
               "--overwrite"]  # (its own comparison: a reproduction started again replaces it)
    copies = [longer / f"{n}-s{s}" for n in names for s in a.seeds]  # (named as their runs)
    if any(copy.is_dir() for copy in copies):
        compare += ["--continued", str(longer)]  # the final value measured on them
    drawn = importlib.util.find_spec("matplotlib") is not None
    if not drawn:
        print("matplotlib is not installed (pip install -r bench/requirements.txt): no plot")
    for baseline in dict.fromkeys([a.baseline, "none"]):  # a tuned baseline, then plain GRPO
        tables = out / "compare"
        if baseline != a.baseline:
            tables = tables / "vs_none"
        for metric, folder in METRICS.items():  # compare/accuracy (avg@k), compare/pass_at_k, ...
            subprocess.run([*compare, "--baseline", baseline, "--metric", metric, "--out-dir",
                            str(tables / folder)], cwd=REPO, check=True)
        if drawn:
            plot(tables / "accuracy")


def plot(tables: Path) -> None:
    """accuracy's plots in `tables`: compare.png (accuracy against generated tokens) and cost.png
    (the GPU-time model, bench/plot.py --cost, the H100's measured ratios marked)."""
    for name, kind in (("compare.png", []), ("cost.png", ["--cost"])):
        subprocess.run([sys.executable, "bench/plot.py", str(tables / "compare.json"),
                        str(tables / name), *kind, "--overwrite"], cwd=REPO, check=True)


if __name__ == "__main__":
    main()
