"""Which runs may be pooled and compared (analysis/compare.py): the seeds of an arm must share a
config and the library versions they ran on, and every arm must measure what the baseline
measures. Each check answers why not in one line (None: they may), which --allow-mixed overrides.
"""

from __future__ import annotations

from config import Config
from support.util import flat_dict

# Keys the seeds of one arm may differ in: where a run writes, how it logs, how fast it runs, how
# often it evaluates (common_grid compares curves on the evals all runs share). Anything else
# (evaluation settings included) changes what the runs measure: not pooled without --allow-mixed.
UNCOMPARED = ("seed", "out_dir", "threads", "wandb.", "checkpoint.", "eval.every",
              "reward.workers", "reward.timeout", "reward.batch_budget",
              "model.gradient_checkpointing", "model.compile", "model.device",
              "optim.micro_batch_size", "optim.logprob_batch_size", "rollout.gen_batch_size",
              "rollout.vllm_")
# Keys that define what a run measures (the model, the problems, how it is evaluated, how long a
# completion may be and how it is sampled, what a reward is): every arm's run must share them with
# the baseline's, or its tokens and accuracies mean something else. Adapters and the other
# training settings are what the arms vary.
MEASURED = ("model.", "data.", "eval.", "reward.", "rollout.max_new_tokens", "rollout.temperature",
            "rollout.top_p", "rollout.top_k", "rollout.stop_tokens")
NOT_MEASURED = ("model.lora.", "model.parallel", *UNCOMPARED)


def incomparable(runs: list[dict], baseline: str) -> str | None:
    """Why the runs cannot be compared as they are (None: they can): a run without config.yaml
    (what it measured cannot be checked), an arm whose runs are not seeds of one config
    (`mixed_configs`), or of several library versions (`mixed_versions`), or a run that measured
    something else than the baseline (`unlike`)."""
    unchecked = [run["path"] for run in runs if not run["config"]]
    if unchecked:
        return (f"{unchecked[0]}: no config.yaml, so what the run measured cannot be checked "
                "against the others; --allow-mixed compares it anyway")
    return mixed_configs(runs, baseline) or mixed_versions(runs) or unlike(runs, baseline)


def mixed_versions(runs: list[dict]) -> str | None:
    """Why a run or an arm mixes library versions (None: none does): a run resumed on other
    versions than it started on (summary.json's `versions` has two), or two runs of one arm made
    on different versions; the numbers move with the library (docs/results.md). Runs that record
    no versions (before #47) are not compared."""
    first = {}
    for run in runs:
        versions = run["versions"]
        if not versions:
            continue
        if len(versions) > 1:
            return (f"{run['path']} ran on several library versions ({'; '.join(versions)}): "
                    "a resume on other versions changes its numbers; --allow-mixed compares it")
        base = first.setdefault(run["strategy"], run)
        if base["versions"] != versions:
            return (f"arm {run['strategy']!r} pools runs of different library versions: "
                    f"{base['path']} ({base['versions'][0]}) and {run['path']} ({versions[0]}); "
                    "--allow-mixed pools them anyway")
    return None


def unlike(runs: list[dict], baseline: str) -> str | None:
    """Why a run measured something else than the baseline's first run (None: none did): their
    resolved configs differ in a MEASURED key. A key one of them lacks takes config.py's default
    (a key is added with the default that keeps the older behaviour); one config.py lacks is not
    compared."""
    base = next((run for run in runs if run["strategy"] == baseline), None)
    defaults = flat_dict(Config())
    for run in runs if base else []:
        a, b = defaults | base["config"], defaults | run["config"]
        for key in sorted(a.keys() & b.keys()):
            if a[key] != b[key] and key.startswith(MEASURED) and not key.startswith(NOT_MEASURED):
                return (f"{run['path']} (arm {run['strategy']!r}) measures something else than "
                        f"the baseline {base['path']}: {key} is {b[key]!r:.30} there, "
                        f"{a[key]!r:.30} in the baseline; --allow-mixed compares them anyway")
    return None


def mixed_configs(runs: list[dict], baseline: str) -> str | None:
    """Why the runs of one arm are not seeds of one experiment (None: they are): two resolved
    configs of the arm differ in a key outside UNCOMPARED. Keys one of them lacks (older code)
    are not compared. The line says how the arm was named (LABEL=, or read from the configs) and
    what each way out does (`pooled_advice`)."""
    first = {}
    for run in runs:
        base = first.setdefault(run["strategy"], run)
        a, b = base["config"], run["config"]
        keys = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
        keys = [k for k in keys if not k.startswith(UNCOMPARED)]
        if keys:
            shown = ", ".join(f"{k} ({a[k]!r:.20} vs {b[k]!r:.20})" for k in keys[:3])
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            return (f"arm {run['strategy']!r} pools runs of different configs: {base['path']} and "
                    f"{run['path']} differ in {shown}{more}; {pooled_advice(base, run, baseline)}")
    return None


def pooled_advice(base: dict, run: dict, baseline: str) -> str:
    """What to do about two runs of one arm whose configs differ: a run given no LABEL= is filed
    under the arm its config names (its replay strategy and methods), so a variant the arm's name
    does not capture (another lr, loss) falls into that arm; a label makes it an arm of its own.
    --allow-mixed pools it as one more seed: of the baseline, if that is the arm, which is rarely
    meant."""
    arm = run["strategy"]
    named = f"both were labelled {arm!r}"
    unlabelled = next((r for r in (run, base) if not r.get("labelled")), None)
    if unlabelled is not None:
        path = unlabelled["path"]
        named = (f"the arm of {path} was read from its config (no LABEL= given); to compare it "
                 f"as an arm of its own, label it (NAME={path})")
    if arm == baseline:
        return f"{named}; --allow-mixed would pool it into the baseline {arm!r} as one more seed"
    return f"{named}; --allow-mixed pools them as seeds of one arm"


# Keys a continued copy (compare.py --continued) may differ in from its run: how long it ran,
# where it wrote, how it logged and checkpointed, its threads. The seed and the rest are the run's.
CONTINUED = ("max_steps", "out_dir", "threads", "wandb.", "checkpoint.")


def not_continued(run: dict, copy: dict) -> str | None:
    """Why `copy` is not `run` continued past its last eval (None: it is): it is unfinished, their
    configs differ beyond CONTINUED, it ran on other library versions, it has no eval after the
    run's last, or its evals up to there differ from the run's in some metric (another run)."""
    steps, last = copy["ended"]  # (a copy made of a finished run holds its summary until its end)
    if not copy["finished"] or steps != last:  # still running: its crossings are not yet its end's
        return f"{copy['path']} is not a finished run (no summary.json of its last step)"
    a, b = run["config"], copy["config"]
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    keys = [k for k in keys if not k.startswith(CONTINUED)]
    where = f"{copy['path']} is not {run['path']} continued"
    if keys:
        return f"{where}: {keys[0]} is {b.get(keys[0])!r:.30} there, {a.get(keys[0])!r:.30} here"
    if copy["versions"] != run["versions"]:
        return f"{where}: it ran on {copy['versions']}, the run on {run['versions']}"
    for metric, curve in run["curves"].items():
        if copy["curves"][metric][: len(curve)] != curve:
            return f"{where}: their evals in {metric} differ before the run's last"
    if len(copy["curves"]["accuracy"]) <= len(run["curves"]["accuracy"]):  # (a prefix of it)
        return f"{where}: it has no eval after the run's last"
    return None
