"""One typed config: dataclasses, YAML files over the defaults (a `base:` file first), then
dotted overrides (`--replay.strategy=aper`). Unknown keys and wrong types are errors naming the key
and the closest one (support/configfile.py reads the files and values). Each section's `check()`
gives {field: (ok, what it must be)}; `validate` runs them all, once. A section one module reads
lives beside it (rollout, reward, grpo, replay, lora, data.tiny).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field

from data.tiny_task import TEST_SIZE, TinyTask
from grpo import GRPOConfig, UpdateSettings
from methods import plugged
from methods.lookahead import PASSES, LookaheadConfig
from replay import ReplayConfig, buffers
from rewards import RewardConfig
from rollout import MIN_TEMPERATURE, RolloutConfig
from support import vllm
from support.checkpoint import CheckpointConfig
from support.checks import MAX_BATCH, budget, sizes
from methods.greso import SkipConfig
from support.models import ModelConfig
from support.rundir import ASIDE, WandbConfig
from methods.stages import StageConfig
from support.configfile import SHORT, ConfigError, parse_value, read_yaml
from support.util import path_fault

MAX_THREADS = 1024  # torch starts them on its first parallel op: 10^11 would never start
OVERLONG = "≤ rollout.max_new_tokens (%d): a longer buffer punishes every completion"
NEVER = "the %s a completion's reward can be (reward.*): else the rule never fires"


@dataclass
class DataConfig:
    train: str = "tiny"
    """Training problems: tiny | math_train | dapo17k | gsm8k_train | .jsonl/.parquet | hf:NAME."""
    eval: str = "tiny"
    """Held-out problems for the periodic eval (spec forms as `train`; comma-separate several)."""
    tiny: TinyTask = field(default_factory=TinyTask)
    """The tiny task's size, difficulty and mix (data/tiny_task.py)."""
    data_dir: str = ""
    """Folder holding benchmark/training files named by spec (e.g. math500_test.jsonl)."""
    problem_key: str = ""
    """Problem field for a custom JSONL (empty = guess from the known schemas)."""
    answer_key: str = ""
    """Answer field for a custom JSONL (empty = guess from the known schemas)."""
    template: str = "{problem}"
    """Instruction text around each problem, which replaces `{problem}` (the one placeholder)."""
    chat_template: bool = True
    """Wrap the instruction in the tokenizer's chat template (when it has one) as a user turn."""
    system_prompt: str = ""
    """System turn (empty = the rows' own if any; a chat template may add its default)."""
    max_prompt_tokens: int = 0
    """Longer prompts are dropped and counted (0 = the context minus rollout.max_new_tokens)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"template": ("{problem}" in self.template, "text containing {problem}"),
                "max_prompt_tokens": (self.max_prompt_tokens >= 0, "≥ 0")}


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """AdamW peak learning rate (after warm-up)."""
    warmup_steps: int = 0
    """Linear warm-up, in generation steps whatever optim.minibatches is (as verl counts it)."""
    schedule: str = "constant"
    """After warm-up: constant | cosine (decays to min_lr_ratio × lr at max_steps)."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    minibatches: int = 1
    """Optimizer steps per generation step: the update batch shuffled, split into this many."""
    epochs: int = 1
    """Passes over each update batch, each reshuffled (GRPO's μ, TRL's num_iterations)."""
    gate: float = 0.0
    """0 = off; else drop a reuse step with lm_head grad norm > gate × the first's, stop (DGG)."""
    update: str = ""
    """`module:function` replacing the update, for a method written outside methods/ (README's
    "How to add a method"); empty: GRPO's passes, or the methods below choose."""
    micro_batch_size: int = 64
    """Rows per forward/backward (memory knob: gradients accumulate, the maths do not change)."""
    micro_batch_tokens: int = 0
    """> 0: rows packed by length into micro-batches of up to this many padded tokens (instead)."""
    logprob_batch_size: int = 128
    """Rows per no-grad forward (proximal / reference log-probs; memory knob)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        gate_ok = self.gate == 0 or (0 < self.gate < 1e6 and self.epochs > 1)
        return {"lr": (0 < self.lr <= 1, "in (0, 1]"),
                "warmup_steps": (self.warmup_steps >= 0, "≥ 0"),
                "schedule": (self.schedule in ("constant", "cosine"), "constant or cosine"),
                "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                "weight_decay": (0 <= self.weight_decay < 1e6, "≥ 0"),
                "beta1": (0 <= self.beta1 < 1, "in [0, 1)"),
                "beta2": (0 <= self.beta2 < 1, "in [0, 1)"),
                "grad_clip": (0 <= self.grad_clip < math.inf, "≥ 0 (0 = off)"),
                "minibatches": (self.minibatches >= 1, "≥ 1"),
                "micro_batch_size": (0 < self.micro_batch_size <= MAX_BATCH, "> 0 and ≤ 10^9"),
                "epochs": (1 <= self.epochs <= 64, "in [1, 64]"),
                "gate": (gate_ok, "0 (off), or > 0 with optim.epochs > 1"),
                "update": (not self.update or plugged(self.update) is not None,
                           "empty, or module:function naming a function on sys.path"),
                "micro_batch_tokens": (0 <= self.micro_batch_tokens <= MAX_BATCH,
                                       "≥ 0 (0 = off) and ≤ 10^9"),
                "logprob_batch_size": (0 < self.logprob_batch_size <= MAX_BATCH, "> 0 and ≤ 10^9")}


def get_lr(step: int, cfg) -> float:
    """Learning rate of generation step `step` (0-based; cfg is the run's config): linear warm-up,
    then constant or cosine decay. Warm-up and decay count generation steps, as verl does."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, cfg.max_steps - o.warmup_steps))
    cosine = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if o.schedule == "cosine":
        return o.lr * cosine
    return o.lr


@dataclass
class EvalConfig:
    every: int = 10
    """Evaluate every N steps (and at step 0 and the end); 0 = only at the start and the end."""
    n: int = 200
    """Held-out problems per eval (0 = all)."""
    k: int = 4
    """Samples per problem; accuracy is avg@k."""
    temperature: float = 1.0
    """Eval sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Eval nucleus sampling."""
    max_new_tokens: int = 0
    """Eval generation cap (0 = rollout.max_new_tokens)."""
    greedy: bool = True
    """Also the greedy accuracy (eval/greedy: one more decode, the most likely completion)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"every": (self.every >= 0, "≥ 0"),
                "n": (self.n >= 0, "≥ 0 (0 = all)"),
                "k": (self.k >= 1, "≥ 1"),
                "temperature": (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < 1e6,
                                f"0 (greedy) or in [{MIN_TEMPERATURE:g}, 1e6)"),
                "top_p": (0 < self.top_p <= 1, "in (0, 1]"),
                "max_new_tokens": (self.max_new_tokens >= 0, "≥ 0")}


@dataclass
class Config:
    out_dir: str = "runs/default"
    """Run folder: config.yaml, metrics.jsonl, summary.json, checkpoints/, final/, eval/, wandb/."""
    seed: int = 0
    """Seeds python, numpy, torch, the training-problem order and the replay sampler."""
    max_steps: int = 100
    """Generation steps (one rollout batch each)."""
    threads: int = 0
    """torch intra-op threads (0 = torch's default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    skip: SkipConfig = field(default_factory=SkipConfig)
    """GRESO's prompt skipping: prompts whose groups were flat on their last visits are skipped."""
    stages: StageConfig = field(default_factory=StageConfig)
    """Staged rollouts: g1 samples per prompt first; a prompt with g1 of g1 correct stops there."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    """Several passes over one batch with drift control: SFPO's reposition, GXPO's extrapolation."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def check(self) -> dict[str, tuple[bool, str]]:
        """The run's own keys and the rules that join two sections."""
        prompts = self.rollout.batch_size // max(1, self.rollout.group_size)
        mb, new = self.optim.minibatches, self.rollout.max_new_tokens
        vllm_ok = self.rollout.engine != "vllm" or vllm.available()
        where = path_fault(self.out_dir, ASIDE) if self.out_dir.strip() else "is empty"
        skip, (low, high) = self.skip.enabled, self.reward.bounds()  # a completion's reward
        return {"max_steps": (self.max_steps >= 0, "≥ 0"),
                "seed": (0 <= self.seed < 2**32, "in [0, 2^32)"),
                "threads": (0 <= self.threads <= MAX_THREADS, f"in [0, {MAX_THREADS}]"),
                "out_dir": (where is None, ("a folder name, not empty, that the file system "
                                            f"can hold (it {where})")),
                "stages.first": (self.stages.first < max(2, self.rollout.group_size),
                                 "below rollout.group_size"),
                "reward.overlong_buffer": (self.reward.overlong_buffer <= new, OVERLONG % new),
                "skip.easy": (not skip or self.skip.easy <= high, f"≤ {high:g}, {NEVER % 'most'}"),
                "skip.hard": (not skip or self.skip.hard >= low, f"≥ {low:g}, {NEVER % 'least'}"),
                "optim.minibatches": (mb < 1 or prompts % mb == 0,
                                      f"a divisor of the prompts per step ({prompts})"),
                "lookahead.method": (self.lookahead.fits(self.optim), PASSES),
                "optim.update": (not self.optim.update or (self.lookahead.method == "none"
                                                           and self.optim.gate == 0),
                                 "empty with lookahead.method or optim.gate (one method replaces "
                                 "the update)"),
                "rollout.engine": (vllm_ok, ("hf when vLLM is not installed "
                                             "(pip install -r requirements-vllm.txt)"))}


def _fields(cls=Config, prefix="") -> dict[str, type]:
    """{dotted key: type} of every field, sections included."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        out[prefix + name] = tp
        if dataclasses.is_dataclass(tp):
            out |= _fields(tp, f"{prefix}{name}.")
    return out


FIELDS = _fields()
BF16 = "bf16 compute is model.compute_dtype=bfloat16"
REMOVED = {"model.dtype": f"master weights are always float32; {BF16}", "model.autocast": BF16,
           "optim.skip_zero_adv": "it is always on"}


def _set(cfg: Config, key: str, value) -> None:
    """Set the dotted `key` to `value`; a ConfigError for a key that is not a field."""
    if key in REMOVED:
        raise ConfigError(f"config key {key} was removed: {REMOVED[key]}")
    tp = FIELDS.get(key)
    if tp is None:
        leaves = [k for k, t in FIELDS.items() if not dataclasses.is_dataclass(t)]
        close = difflib.get_close_matches(key, leaves, 1, 0.5)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown config key {key}{hint}")
    if dataclasses.is_dataclass(tp):
        first = dataclasses.fields(tp)[0].name
        raise ConfigError(f"config key {key} is a section; set one of its fields, "
                          f"e.g. {key}.{first}")
    section, _, name = key.rpartition(".")
    setattr(_get(cfg, section), name, parse_value(key, value, tp))


def load_config(path: str | None, overrides: list[str]) -> Config:
    """Defaults, then the YAML file at `path` (after its `base` chain; a `--config FILE` among the
    overrides takes its place), then the `--key=value` / `--key value` overrides."""
    pairs = []
    args = iter(overrides)
    for arg in args:
        key, eq, value = arg.partition("=")
        if not key.startswith("--"):
            raise ConfigError(f"unexpected argument {SHORT.repr(arg)}; "
                              "overrides look like --optim.lr=1e-3")
        if not eq:  # --key value
            value = next(args, None)
        if value is None:
            need = "--config needs a file" if key == "--config" else f"override {key} needs a value"
            raise ConfigError(need)
        if key == "--config":
            path = value
        else:
            pairs.append((key[2:], value))
    if path == "":
        raise ConfigError("--config needs a file")
    cfg = Config()
    for k, v in [*(read_yaml(path) if path else {}).items(), *pairs]:
        _set(cfg, k, v)
    return cfg


def typed_mapping(node: dict, prefix: str = "") -> dict:
    """A saved config.yaml's mapping (nested sections), each value of a key config.py knows taken
    as `--key=value` takes it (`parse_value`), a section as a mapping; keys config.py does not know
    (older or newer code) kept as they are. ConfigError for the first it refuses."""
    out = {}
    for name, value in node.items():
        key = f"{prefix}{name}"
        tp = FIELDS.get(key)
        section = tp is not None and dataclasses.is_dataclass(tp)
        if section and not isinstance(value, dict):
            raise ConfigError(f"config key {key} is a section (a mapping), got {SHORT.repr(value)}")
        if isinstance(value, dict):
            out[name] = typed_mapping(value, f"{key}.")
        elif tp is not None:
            out[name] = parse_value(key, value, tp)
        else:
            out[name] = value
    return out


def split_flags(argv: list[str], names: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """A command's own flags among `argv` ({--name: the text after `=`, or ""}) and the rest: the
    config's overrides."""
    flags, rest = {}, []
    for arg in argv:
        name, _, value = arg.partition("=")
        if name in names:
            flags[name] = value
        else:
            rest.append(arg)
    return flags, rest


def validate(cfg: Config) -> None:
    """Reject values that would fail later, silently train nonsense, or never finish, with one
    message naming the key: every section's rules, then what the run allocates and generates."""
    check_rules(cfg, _rules(cfg))
    cfg.wandb.check_environment()
    specs = cfg.data.eval.split(",")
    # eval.n = 0 takes every problem: the tiny task's held-out split, a file's once it is loaded
    eval_problems = cfg.eval.n * len(specs) if cfg.eval.n else TEST_SIZE * specs.count("tiny")
    longest = cfg.rollout.max_new_tokens + 1  # (a prompt of one token at least)
    check_rules(cfg, budget(cfg, eval_problems, sizes(longest, buffers(cfg.replay))))


def _rules(section, prefix: str = "") -> list[tuple[str, bool, str]]:
    """(dotted key, ok, rule) of the rules of `section`'s sections, then of its own `check()`."""
    rules = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            rules += _rules(value, f"{prefix}{f.name}.")
    for key, (ok, rule) in section.check().items():
        rules.append((prefix + key, ok, rule))
    return rules


def check_rules(cfg: Config, rules: list[tuple[str, bool, str]]) -> None:
    """ConfigError for the first rule that fails: `{key} must be {rule}, got {value}`."""
    for key, ok, rule in rules:
        if not ok:
            raise ConfigError(f"{key} must be {rule}, got {SHORT.repr(_get(cfg, key))}")


def check_flags(values: dict[str, tuple[str, object]]) -> None:
    """A command other than train.py (eval.py) checks its flags by the config's own rules:
    `values` maps a dotted key to (the flag that gives it, its value). ConfigError, naming the
    flag, for the first that breaks its key's rule."""
    cfg = Config()
    for key, (_, value) in values.items():
        section, _, name = key.rpartition(".")
        setattr(_get(cfg, section), name, value)
    for key, ok, rule in _rules(cfg):
        if key in values and not ok:
            flag = values[key][0]
            raise ConfigError(f"{flag} must be {rule}, got {SHORT.repr(_get(cfg, key))}")


def _get(cfg: Config, key: str):
    """The value of a dotted key ("" = cfg itself)."""
    for part in filter(None, key.split(".")):
        cfg = getattr(cfg, part)
    return cfg


def update_settings(cfg: Config) -> UpdateSettings:
    """What grpo.update_policy reads of `cfg`: grpo.py takes no Config."""
    return UpdateSettings(loss=cfg.grpo, optim=cfg.optim,
                          temperature=cfg.rollout.temperature,
                          max_new_tokens=cfg.rollout.max_new_tokens,
                          mask_truncated=cfg.rollout.mask_truncated,
                          engine=cfg.rollout.engine,
                          gradient_checkpointing=cfg.model.gradient_checkpointing,
                          stoppable=cfg.lookahead.method != "none" or cfg.optim.epochs > 1)
