"""The methods a researcher compares beside replay.py, each a file that replaces or wraps one phase
of train.py's step, picked once at set-up (`compose_update`, `compose_rollout`): a method that is
off is not in the step at all.

  greso.py      GRESO's prompt skipping: replaces the data order's next prompts (skip.enabled)
  stages.py     staged rollouts: wraps a round's generate-and-reward (stages.first)
  dynamic.py    DAPO's dynamic sampling: rounds around the rollout (rollout.dynamic_sampling)
  gate.py       several passes with DGG's gate: replaces the update (optim.epochs > 1)
  lookahead.py  SFPO, GXPO: replace the update (lookahead.method)

Adding one: its file (the phase it fills and its config section), the section in config.py, a
branch here. An update written outside methods/ needs none of these: `optim.update=module:function`
(tests/kl_stop.py is one).
"""

import sys

import grpo
from data.loaders import next_prompts
from methods.dynamic import Dynamic
from methods.gate import reuse_update
from methods.greso import PromptSkip
from methods.lookahead import make_lookahead
from methods.stages import Stages
from replay import imports


def plugged(spec: str):
    """The function `module:function` names (optim.update), or None when there is none."""
    module, _, name = spec.partition(":")
    # ".x" is a relative import (import_module's TypeError: no package to be relative to)
    if not module or module.startswith(".") or not name or not imports(module):
        return None
    update = getattr(sys.modules[module], name, None)
    if not callable(update):
        return None
    return update


def compose_update(cfg, methods: dict):
    """The update phase: plain GRPO (grpo.update_policy), or the method that replaces it: one
    written outside methods/ (optim.update), SFPO or GXPO (lookahead.method), or several passes
    with DGG's gate (optim.epochs > 1). A method with state joins `methods`, which checkpoints
    save."""
    if cfg.optim.update:
        update = plugged(cfg.optim.update)
        if hasattr(update, "state_dict"):
            methods["update"] = update
        return update
    if cfg.lookahead.method != "none":
        methods["lookahead"] = make_lookahead(cfg.lookahead, cfg.optim)
        return methods["lookahead"]
    if cfg.optim.epochs > 1:
        return reuse_update
    return grpo.update_policy


def compose_rollout(cfg, n_prompts: int, pad: int, one_round, plain_complete, methods: dict,
                    observers: list, generators: list) -> tuple:
    """(choose, complete, rollout): the next prompts (the data order, or GRESO's skipping), a
    round's generate-and-reward (`plain_complete`, or staged rollouts) and the rollout phase
    (`one_round`, or DAPO's rounds of it). The methods that are on join `methods` (checkpoints),
    `observers` when they learn from each step's final rollout, `generators` when a stop must put
    back their RNG."""
    choose, complete, rollout = next_prompts, plain_complete, one_round
    if cfg.skip.enabled:
        skip = PromptSkip(cfg.skip, n_prompts, cfg.seed)  # the same state on every rank
        choose = skip.choose
        methods["skip"] = skip
        observers.append(skip)
        generators.append(skip.gen)
    if cfg.stages.first > 0:
        stages = Stages(cfg.stages, pad)
        complete = stages.complete
        methods["stages"] = stages
        observers.append(stages)
    if cfg.rollout.dynamic_sampling:
        rollout = Dynamic(one_round, cfg.rollout.dynamic_sampling, pad)
    return choose, complete, rollout
