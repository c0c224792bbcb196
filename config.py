"""One typed config: nested dataclasses, YAML files that overlay the defaults (a `base:` file first), then dotted
command-line overrides (`--replay.strategy=aper --optim.lr=1e-3`). Unknown keys and wrong types are errors naming the
key and the closest valid one. Every field has a docstring; every section lists its rules in `check()`
({field: (ok, what it must be)}), and `validate` runs them all. Sections owned by a module (rollout, reward, grpo,
replay) live next to the code that reads them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

import vllm_engine
from grpo import GRPOConfig
from lora import LoraConfig
from replay import ReplayConfig
from rewards import RewardConfig
from rollout import RolloutConfig


class ConfigError(ValueError):
    """A bad config key, value or file: train.py prints it on one line and exits 2."""


@dataclass
class ModelConfig:
    path: str = "data/tiny_model"
    """Hugging Face model folder or hub id (loaded with AutoModelForCausalLM / AutoTokenizer)."""
    trust_remote_code: bool = False
    """Allow model code from the model folder to run. Off: only architectures transformers ships."""
    compute_dtype: str = "float32"
    """float32 | bfloat16: forward, backward and generation. Master weights and AdamW state are
    always float32 (under LoRA the frozen base is held in this dtype)."""
    parallel: str = "ddp"
    """ddp | fsdp: how torchrun's processes share the model (FSDP2 shards weights, gradients and optimizer state)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (real models, long responses)."""
    compile: bool = False
    """torch.compile the model for the training forward (generation stays eager; shapes vary, expect recompiles)."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N. auto = cuda when available (the local rank's GPU under torchrun)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on a frozen base (lora.rank 0 = off: full fine-tuning)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        cuda = self.device.startswith("cuda")
        rules = {f"lora.{k}": rule for k, rule in self.lora.check().items()}
        dtype_ok = self.compute_dtype in ("float32", "bfloat16")
        rules["compute_dtype"] = (dtype_ok, "float32 or bfloat16")
        rules["parallel"] = (self.parallel in ("ddp", "fsdp"), "ddp or fsdp")
        named_ok = self.device in ("auto", "cpu") or cuda
        device_ok = named_ok and (not cuda or torch.cuda.is_available())
        rules["device"] = (device_ok, "auto, cpu or cuda[:N], and cuda needs a visible GPU")
        return rules


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
    """Instruction text around each problem; `{problem}` is replaced by the problem (no other placeholders)."""
    chat_template: bool = True
    """Wrap the instruction in the tokenizer's chat template (when it has one) as a user turn."""
    system_prompt: str = ""
    """System turn (empty = the data's own if its rows carry one, else none; a template may add its default)."""
    max_prompt_tokens: int = 0
    """Prompts longer than this are dropped and counted (0 = the model's context minus rollout.max_new_tokens)."""
    tiny_train_size: int = 2000
    """Number of distinct training problems generated for the tiny task (prompts recur across epochs)."""
    tiny_max_int: int = 20
    """Tiny task difficulty: largest operand."""
    tiny_max_den: int = 6
    """Tiny task difficulty: largest fraction denominator."""
    tiny_kinds: str = "add:3,mul:2,frac:2,lin:2"
    """Tiny task mix as kind:weight pairs (add, mul, frac, lin)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"template": ("{problem}" in self.template, "text containing {problem}"), "max_prompt_tokens": (
                self.max_prompt_tokens >= 0, "≥ 0"), "tiny_train_size": (self.tiny_train_size >= 1, "≥ 1"),
                "tiny_max_int": (self.tiny_max_int >= 2, "≥ 2"), "tiny_max_den": (self.tiny_max_den >= 2, "≥ 2")}


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """AdamW peak learning rate (after warm-up)."""
    warmup_steps: int = 0
    """Linear warm-up, in generation steps (max_steps units) whatever optim.minibatches is, as verl counts it."""
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
    """Optimizer steps per generation step; the update batch's rows are shuffled and split into this many."""
    epochs: int = 1
    """Passes over each update batch, each reshuffled (GRPO's μ, TRL's num_iterations)."""
    gate: float = 0.0
    """0 = off; else drop a reuse step with lm_head grad norm > gate × the first, and stop (DGG)."""
    micro_batch_size: int = 64
    """Rows per forward/backward (memory knob); gradients accumulate over micro-batches: no effect on the maths."""
    micro_batch_tokens: int = 0
    """> 0: rows packed by length into micro-batches of up to this many padded tokens (instead)."""
    logprob_batch_size: int = 128
    """Rows per no-grad forward (proximal / reference log-probs; memory knob)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"lr": (0 < self.lr <= 1, "in (0, 1]"), "warmup_steps": (self.warmup_steps >= 0, "≥ 0"),
                "schedule": (self.schedule in ("constant", "cosine"), "constant or cosine"),
                "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                "weight_decay": (0 <= self.weight_decay < 1e6, "≥ 0"),
                "beta1": (0 <= self.beta1 < 1, "in [0, 1)"), "beta2": (0 <= self.beta2 < 1, "in [0, 1)"),
                "grad_clip": (0 <= self.grad_clip < math.inf, "≥ 0 (0 = off)"),
                "minibatches": (self.minibatches >= 1, "≥ 1"), "micro_batch_size": (self.micro_batch_size > 0, "> 0"),
                "epochs": (1 <= self.epochs <= 64, "in [1, 64]"),
                "gate": (self.gate == 0 or (0 < self.gate < 1e6 and self.epochs > 1),
                         "0 (off), or > 0 with optim.epochs > 1"),
                "micro_batch_tokens": (self.micro_batch_tokens >= 0, "≥ 0 (0 = off)"),
                "logprob_batch_size": (self.logprob_batch_size > 0, "> 0")}


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

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"every": (self.every >= 0, "≥ 0"), "n": (self.n >= 0, "≥ 0 (0 = all)"), "k": (self.k >= 1, "≥ 1"),
                "temperature": (0 <= self.temperature < 1e6, "≥ 0"), "top_p": (0 < self.top_p <= 1, "in (0, 1]"),
                "max_new_tokens": (self.max_new_tokens >= 0, "≥ 0")}


@dataclass
class CheckpointConfig:
    every: int = 50
    """Save a resumable checkpoint every N steps and after the last (0 = none: only the final model)."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted after a new one is complete."""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"every": (self.every >= 0, "≥ 0 (0 = off)"), "keep_last": (self.keep_last >= 1, "≥ 1")}


@dataclass
class WandbConfig:
    mode: str = "offline"
    """disabled | offline | online."""
    project: str = "replay-grpo"
    """wandb project."""
    group: str = ""
    """Runs of one comparison share a group (default: none)."""
    name: str = ""
    """Run name (default: strategy-seed)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"mode": (self.mode in ("disabled", "offline", "online"), "disabled, offline or online")}


@dataclass
class Config:
    out_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, summary.json, checkpoints/, final/ (and eval/, wandb/)."""
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

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"max_steps": (self.max_steps >= 0, "≥ 0"), "seed": (self.seed >= 0, "≥ 0"),
                "threads": (self.threads >= 0, "≥ 0"),
                "out_dir": (self.out_dir.strip() != "", "a folder name, not empty")}


def _fields(cls=Config, prefix="") -> dict[str, type]:
    """{dotted key: type} of every field, sections included."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        out[prefix + name] = tp
        out |= _fields(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else {}
    return out


FIELDS = _fields()
REMOVED = {"model.dtype": "master weights are always float32; bf16 compute is model.compute_dtype=bfloat16",
           "model.autocast": "bf16 compute is model.compute_dtype=bfloat16", "optim.skip_zero_adv": "it is always on"}
_repr = reprlib.Repr()  # values in messages stay short (a YAML alias bomb would print megabytes)
_repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict, _repr.maxlevel = 60, 60, 4, 4, 2


BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _parse(key: str, value, tp):
    """`value` as the field's type `tp` (strings from the command line are parsed), or a ConfigError."""
    if isinstance(value, str) and tp is bool and value.lower() in BOOLS:
        return BOOLS[value.lower()]
    if isinstance(value, str) and tp in (int, float):
        try:
            return tp(value)
        except ValueError:
            pass
    if isinstance(value, str) and tp == list[str]:  # --rollout.stop_tokens=a,b
        return [v for v in value.split(",") if v]
    if (tp is float and type(value) is int) or (tp is str and type(value) in (int, float)):
        return tp(value)
    if type(value) is tp or (tp == list[str] and isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise ConfigError(f"config key {key} expects {getattr(tp, '__name__', tp)}, got {_repr.repr(value)}")


def _set(cfg: Config, key: str, value) -> None:
    tp = FIELDS.get(key)
    if key in REMOVED or tp is None:
        leaves = [k for k, t in FIELDS.items() if not dataclasses.is_dataclass(t)]
        close = difflib.get_close_matches(key, leaves, 1, 0.5)
        raise ConfigError(f"config key {key} was removed: {REMOVED[key]}" if key in REMOVED else
                          f"unknown config key {key}" + (f"; did you mean {close[0]}?" if close else ""))
    if dataclasses.is_dataclass(tp):
        first = dataclasses.fields(tp)[0].name
        raise ConfigError(f"config key {key} is a section; set one of its fields, e.g. {key}.{first}")
    *sections, name = key.split(".")
    for part in sections:
        cfg = getattr(cfg, part)
    setattr(cfg, name, _parse(key, value, tp))


def _flatten(d: dict, prefix: str = "") -> dict:
    return {k: v for name, x in d.items() for k, v in (_flatten(x, f"{prefix}{name}.") if isinstance(x, dict)
                                                         else {f"{prefix}{name}": x}).items()}


def read_yaml(path: str | Path, seen: tuple = ()) -> dict:
    """Flat {dotted key: value} of a YAML file; a top-level `base: other.yaml` (relative to it) is read first."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    if p.resolve() in seen:
        raise ConfigError(f"config file {path} includes itself through `base`")
    try:
        if p.stat().st_size > 1 << 20:  # a config is a few KB: this bounds what a bad or hostile file can cost
            raise ConfigError(f"config file {path} is over 1 MB: not a config")
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"config file {path}: base must be one file name, got {_repr.repr(base)}")
    return {**(read_yaml(p.parent / base, seen + (p.resolve(),)) if base else {}), **_flatten(data)}


def load_config(path: str | None, overrides: list[str]) -> Config:
    """Defaults, then the YAML file at `path` (after its `base` chain; a `--config FILE` among the overrides takes its
    place), then the `--key=value` / `--key value` overrides."""
    pairs, i = [], 0
    while i < len(overrides):
        key, eq, value = overrides[i].partition("=")
        if not key.startswith("--"):
            raise ConfigError(f"unexpected argument {_repr.repr(overrides[i])}; overrides look like --optim.lr=1e-3")
        if not eq and i + 1 >= len(overrides):
            raise ConfigError("--config needs a file" if key == "--config" else f"override {key} needs a value")
        value, i = (value, i + 1) if eq else (overrides[i + 1], i + 2)
        path, pairs = (value, pairs) if key == "--config" else (path, pairs + [(key[2:], value)])
    if path == "":
        raise ConfigError("--config needs a file")
    cfg = Config()
    for k, v in [*(read_yaml(path) if path else {}).items(), *pairs]:
        _set(cfg, k, v)
    return cfg


def flat_dict(cfg: Config) -> dict:
    """{dotted key: value} of every leaf."""
    return _flatten(dataclasses.asdict(cfg))


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def validate(cfg: Config) -> None:
    """Reject values that would fail later or silently train nonsense, with one message naming the key. Every rule is a
    comparison that cannot raise, so validation itself never fails on a bad value."""
    prompts, mb = cfg.rollout.batch_size // max(1, cfg.rollout.group_size), cfg.optim.minibatches
    rules = [(k, ok, rule) for k, (ok, rule) in cfg.check().items()]
    for name in ("model", "data", "rollout", "reward", "grpo", "replay", "optim", "eval", "checkpoint", "wandb"):
        rules += [(f"{name}.{k}", ok, rule) for k, (ok, rule) in getattr(cfg, name).check().items()]
    rules += [("optim.minibatches", mb < 1 or prompts % mb == 0, f"a divisor of the prompts per step ({prompts})")]
    vllm = cfg.rollout.engine != "vllm" or vllm_engine.available()
    install = "hf when vLLM is not installed (pip install -r requirements-vllm.txt)"
    rules += [("rollout.engine", vllm, install)]
    for key, ok, rule in rules:
        if not ok:
            value = cfg
            for part in key.split("."):
                value = getattr(value, part)
            raise ConfigError(f"{key} must be {rule}, got {_repr.repr(value)}")
