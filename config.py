"""One typed config for everything: nested dataclasses, YAML overlays, dotted CLI overrides.

  python train.py --config configs/tiny.yaml --replay.strategy=aper --optim.lr=1e-3 --out_dir=runs/x

Precedence: dataclass defaults < YAML file < command line. Unknown keys and values of the wrong type are
errors that name the key and suggest the closest valid one. Every field has a one-line docstring under it.
The sections owned by a module (grpo, replay, reward) are defined next to the code that reads them.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from grpo import GRPOConfig
from replay import ReplayConfig
from rewards import RewardConfig


class ConfigError(ValueError):
    """A bad config key, value or file: train.py prints it on one line and exits 2."""


@dataclass
class ModelConfig:
    path: str = "data/tiny_model"
    """Hugging Face model folder or hub id (loaded with AutoModelForCausalLM / AutoTokenizer)."""
    trust_remote_code: bool = False
    """Allow model code from the model folder to run. Off: only architectures transformers ships."""
    dtype: str = "float32"
    """Weights dtype: float32 | bfloat16 (bf16 on GPUs; the optimizer keeps the same dtype)."""
    autocast: bool = False
    """Run forward passes under bf16 autocast while keeping float32 weights."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (real models, long responses)."""
    compile: bool = False
    """torch.compile the model for the training forward (generation stays eager; shapes vary, so expect a few recompiles)."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N. auto = cuda when available (the local rank's GPU under torchrun)."""


@dataclass
class DataConfig:
    train: str = "tiny"
    """Training problems: tiny | math_train | dapo17k | gsm8k_train | a .jsonl/.parquet path | hf:NAME[:split]."""
    eval: str = "tiny"
    """Held-out problems for the periodic eval (same spec forms as `train`; comma-separate several)."""
    data_dir: str = ""
    """Folder holding benchmark/training files named by spec (e.g. math500_test.jsonl)."""
    problem_key: str = ""
    """Problem field for a custom JSONL (empty = guess from the known schemas)."""
    answer_key: str = ""
    """Answer field for a custom JSONL (empty = guess from the known schemas)."""
    template: str = "{problem}"
    """Instruction wrapped around each problem before the chat template; must contain {problem}."""
    tiny_train_size: int = 2000
    """Number of distinct training problems generated for the tiny task (prompts recur across epochs)."""
    tiny_max_int: int = 20
    """Tiny task difficulty: largest operand."""
    tiny_max_den: int = 6
    """Tiny task difficulty: largest fraction denominator."""
    tiny_kinds: str = "add:3,mul:2,frac:2,lin:2"
    """Tiny task mix as kind:weight pairs (add, mul, frac, lin)."""


@dataclass
class RolloutConfig:
    batch_size: int = 256
    """Fresh rollouts generated per step (= prompts per step × group_size)."""
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are relative within a group."""
    max_new_tokens: int = 48
    """Generation length cap; longer completions are truncated and flagged."""
    temperature: float = 1.0
    """Sampling temperature; log-probs in the loss use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; behaviour log-probs are of the truncated distribution actually sampled."""
    gen_batch_size: int = 256
    """Sequences per HF `generate` call (memory knob for generation; a call may mix several prompts' groups)."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """AdamW learning rate after warm-up (constant afterwards)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    minibatches: int = 1
    """Optimizer steps per generation step; the update batch is split into this many mini-batches of whole groups."""
    micro_batch_size: int = 64
    """Rows per forward/backward (training memory knob); rows are length-sorted, gradients accumulate: no effect on the maths."""
    logprob_batch_size: int = 128
    """Rows per no-grad forward (proximal / reference log-probs; memory knob)."""
    skip_zero_adv: bool = True
    """Skip the forward/backward of rows with advantage 0 (exactly 0 gradient when grpo.beta = 0); loss metrics cover trained rows."""


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


@dataclass
class CheckpointConfig:
    every: int = 50
    """Save a resumable checkpoint every N steps (0 = only the final model)."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted after a new one is complete."""


@dataclass
class WandbConfig:
    mode: str = "offline"
    """disabled | offline | online."""
    project: str = "replay-grpo"
    """wandb project."""
    group: str = ""
    """Runs of one comparison share a group (default: the config file's name)."""
    name: str = ""
    """Run name (default: strategy-seed)."""


@dataclass
class Config:
    out_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, summary.json, checkpoints/, final/."""
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
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def _field_types(cls) -> dict[str, type]:
    return typing.get_type_hints(cls)


def _unknown(key: str) -> ConfigError:
    valid = [k for k in all_keys() if not dataclasses.is_dataclass(_lookup_type(k))]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"unknown config key {key}{hint}")


def all_keys() -> list[str]:
    def walk(cls, prefix):
        for name, tp in _field_types(cls).items():
            yield prefix + name
            if dataclasses.is_dataclass(tp):
                yield from walk(tp, prefix + name + ".")

    return list(walk(Config, ""))


def _lookup_type(key: str):
    tp = Config
    for part in key.split("."):
        tp = _field_types(tp)[part]
    return tp


def _coerce(key: str, value, tp):
    """Check/convert one leaf value to the field's declared type; strings from the CLI are parsed."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # only `X | None` is used
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"config key {key} expects {getattr(tp, '__name__', tp)}, got {value!r}")


def _set(cfg: Config, key: str, value) -> None:
    obj, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        hints = _field_types(type(obj))
        if part not in hints:
            raise _unknown(key)
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(hints[part]):
                raise ConfigError(f"config key {key} is a section; set one of its fields, e.g. {key}.{dataclasses.fields(hints[part])[0].name}")
            setattr(obj, part, _coerce(key, value, hints[part]))
        else:
            if not dataclasses.is_dataclass(hints[part]):
                raise _unknown(key)
            obj = getattr(obj, part)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_yaml(path: str | Path, seen: tuple = ()) -> dict:
    """Flat {dotted key: value} of a YAML config; a top-level `base: other.yaml` (relative to this file) is read first."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    if p.resolve() in seen:
        raise ConfigError(f"config file {path} includes itself through `base`")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    base = data.pop("base", None)
    flat = read_yaml(p.parent / base, seen + (p.resolve(),)) if base else {}
    return {**flat, **flatten(data)}


def load_config(path: str | None, overrides: list[str]) -> Config:
    """Defaults, then the YAML file at `path` (after its `base` chain), then `--key=value` / `--key value` overrides."""
    cfg = Config()
    if path:
        for k, v in read_yaml(path).items():
            _set(cfg, k, v)
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --optim.lr=1e-3")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(overrides):
                raise ConfigError(f"override --{key} needs a value")
            value, i = overrides[i + 1], i + 1
        _set(cfg, key, value)
        i += 1
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def validate(cfg: Config) -> None:
    """Reject values that would fail later or silently train nonsense; one message per problem."""
    checks = [
        (cfg.max_steps >= 0, f"max_steps must be ≥ 0, got {cfg.max_steps}"),
        (cfg.rollout.group_size >= 2, f"rollout.group_size must be ≥ 2 (GRPO compares completions within a group), got {cfg.rollout.group_size}"),
        (cfg.rollout.batch_size > 0 and cfg.rollout.batch_size % cfg.rollout.group_size == 0,
         f"rollout.batch_size ({cfg.rollout.batch_size}) must be a positive multiple of rollout.group_size ({cfg.rollout.group_size})"),
        (cfg.rollout.max_new_tokens > 0, f"rollout.max_new_tokens must be > 0, got {cfg.rollout.max_new_tokens}"),
        (cfg.rollout.temperature > 0, f"rollout.temperature must be > 0 (log-probs are taken at it), got {cfg.rollout.temperature}"),
        (0 < cfg.rollout.top_p <= 1, f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}"),
        (cfg.optim.lr > 0, f"optim.lr must be > 0, got {cfg.optim.lr}"),
        (cfg.optim.micro_batch_size > 0 and cfg.optim.logprob_batch_size > 0, "optim.micro_batch_size and optim.logprob_batch_size must be > 0"),
        (cfg.optim.minibatches >= 1 and (cfg.rollout.batch_size // cfg.rollout.group_size) % cfg.optim.minibatches == 0,
         f"optim.minibatches ({cfg.optim.minibatches}) must divide the prompts per step ({cfg.rollout.batch_size // cfg.rollout.group_size})"),
        (cfg.grpo.adv_scale in ("group", "batch", "none"), f"grpo.adv_scale must be group, batch or none, got {cfg.grpo.adv_scale!r}"),
        (cfg.grpo.loss_agg in ("grpo", "dapo", "dr_grpo"), f"grpo.loss_agg must be grpo, dapo or dr_grpo, got {cfg.grpo.loss_agg!r}"),
        (cfg.grpo.offpolicy in ("behaviour", "decoupled"), f"grpo.offpolicy must be behaviour or decoupled, got {cfg.grpo.offpolicy!r}"),
        (cfg.grpo.eps_low >= 0 and cfg.grpo.eps_high >= 0, "grpo.eps_low and grpo.eps_high must be ≥ 0"),
        (cfg.grpo.dual_clip == 0 or cfg.grpo.dual_clip > 1, f"grpo.dual_clip must be 0 (off) or > 1, got {cfg.grpo.dual_clip}"),
        (cfg.grpo.is_cap >= 1, f"grpo.is_cap must be ≥ 1, got {cfg.grpo.is_cap}"),
        (cfg.grpo.beta >= 0, f"grpo.beta must be ≥ 0, got {cfg.grpo.beta}"),
        (cfg.replay.strategy in ("none", "uniform", "aper", "rlep", "exgrpo"),
         f"replay.strategy must be none, uniform, aper, rlep or exgrpo, got {cfg.replay.strategy!r}"),
        (cfg.replay.strategy not in ("uniform", "exgrpo") or 0 <= cfg.replay.ratio < 1,
         f"replay.ratio must be in [0, 1) for {cfg.replay.strategy} (the replayed share of the batch), got {cfg.replay.ratio}"),
        (cfg.replay.strategy != "aper" or 0 <= cfg.replay.ratio <= 4, f"replay.ratio must be in [0, 4] for aper (replayed rows per fresh row), got {cfg.replay.ratio}"),
        (cfg.replay.tau_max >= 1, f"replay.tau_max must be ≥ 1, got {cfg.replay.tau_max}"),
        (cfg.replay.capacity >= 1, f"replay.capacity must be ≥ 1, got {cfg.replay.capacity}"),
        (cfg.replay.advantage in ("stored", "recompute"), f"replay.advantage must be stored or recompute, got {cfg.replay.advantage!r}"),
        (cfg.model.dtype in ("float32", "bfloat16"), f"model.dtype must be float32 or bfloat16, got {cfg.model.dtype!r}"),
        (cfg.wandb.mode in ("disabled", "offline", "online"), f"wandb.mode must be disabled, offline or online, got {cfg.wandb.mode!r}"),
        ("{problem}" in cfg.data.template, "data.template must contain {problem}"),
        (cfg.eval.k >= 1 and cfg.eval.n >= 0, "eval.k must be ≥ 1 and eval.n ≥ 0"),
        (cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last must be ≥ 1, got {cfg.checkpoint.keep_last}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
