"""The typed config: YAML overlays, dotted overrides, and errors that name the key."""

import re
import subprocess
import sys

import pytest

from config import Config, ConfigError, load_config, validate

from fixtures import REPO  # (tests/fixtures.py: the repository's root)


def test_defaults_yaml_then_cli(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 3\noptim:\n  lr: 0.5\nreplay:\n  strategy: uniform\n")
    cfg = load_config(str(f), ["--optim.lr=1e-5", "--replay.tau_max", "7",
                               "--model.gradient_checkpointing=true"])
    assert isinstance(cfg, Config)
    assert cfg.seed == 3  # from YAML
    assert cfg.optim.lr == 1e-5  # CLI beats YAML
    assert cfg.replay.strategy == "uniform"
    assert cfg.replay.tau_max == 7 and isinstance(cfg.replay.tau_max, int)
    assert cfg.model.gradient_checkpointing is True
    assert cfg.rollout.group_size == Config().rollout.group_size  # untouched default


@pytest.mark.parametrize(
    "override, message",
    [
        ("--optim.lrr=1", "unknown config key optim.lrr; did you mean optim.lr?"),
        ("--replay.stratgy=aper", "did you mean replay.strategy?"),
        ("--seed=abc", "config key seed expects int, got 'abc'"),
        ("--model.gradient_checkpointing=maybe", "expects bool"),
        ("--optim=1", "config key optim is a section"),
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        load_config(None, [override])


def test_wrong_type_in_yaml_and_missing_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  group_size: 2.5\n")
    with pytest.raises(ConfigError, match="rollout.group_size expects int"):
        load_config(str(f), [])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"), [])


# Every setting that would crash later or be silently reinterpreted: one message naming the key,
# from validate itself (which never raises anything else, whatever the values).
BAD_SETTINGS = [
    ("--rollout.group_size=1", "rollout.group_size must be ≥ 2"),
    ("--rollout.group_size=0", "rollout.group_size must be ≥ 2"),
    ("--rollout.batch_size=100", "multiple of rollout.group_size"),
    ("--rollout.max_new_tokens=0", "rollout.max_new_tokens must be > 0"),
    ("--rollout.gen_batch_size=0", "rollout.gen_batch_size must be > 0"),
    ("--rollout.temperature=nan", "rollout.temperature must be > 0"),
    ("--rollout.top_k=-1", "rollout.top_k must be ≥ 0"),
    ("--optim.lr=-1e-3", "optim.lr must be in (0, 1]"),
    ("--optim.lr=inf", "optim.lr must be in (0, 1]"),
    ("--optim.lr=1e30", "optim.lr must be in (0, 1]"),
    ("--optim.minibatches=0", "optim.minibatches must be ≥ 1"),
    ("--optim.minibatches=3",
     "optim.minibatches must be a divisor of the prompts per step (32), got 3"),
    ("--optim.schedule=linear", "optim.schedule must be constant or cosine"),
    ("--threads=-1", "threads must be in [0, 1024]"),
    ("--seed=-1", "seed must be in [0, 2^32)"),
    ("--max_steps=-5", "max_steps must be ≥ 0"),
    ("--out_dir=", "out_dir must be a folder name, not empty"),
    ("--data.template=Solve {question}", "data.template must be text containing {problem}"),
    ("--data.tiny.train_size=0", "data.tiny.train_size must be in [1, 13,041]"),
    ("--data.tiny.max_int=1", "data.tiny.max_int must be ≥ 2"),
    ("--data.tiny.kinds=add:3,div:1", "data.tiny.kinds must be kind:weight pairs"),
    ("--checkpoint.every=-1", "checkpoint.every must be ≥ 0"),
    ("--checkpoint.keep_last=0", "checkpoint.keep_last must be ≥ 1"),
    ("--eval.k=0", "eval.k must be ≥ 1"),
    ("--reward.timeout=0", "reward.timeout must be > 0"),
    ("--reward.timeout=-1", "reward.timeout must be > 0"),
    ("--reward.workers=0", "reward.workers must be an integer in [1, 256]"),
    ("--model.compute_dtype=float16", "model.compute_dtype must be float32 or bfloat16"),
    ("--model.parallel=zero3", "model.parallel must be ddp or fsdp"),
    ("--grpo.loss_agg=mean", "grpo.loss_agg must be grpo, dapo or dr_grpo"),
    ("--grpo.dual_clip=0.5", "grpo.dual_clip must be 0 (off) or > 1"),
    ("--wandb.mode=cloud", "wandb.mode must be disabled, offline or online"),
    ("--replay.strategy=fifo", "replay.strategy must be one of"),
    ("--replay.capacity=0", "replay.capacity must be ≥ 1"),
]


@pytest.mark.parametrize("override, message", BAD_SETTINGS, ids=[b[0] for b in BAD_SETTINGS])
def test_validate(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(None, [override]))


# The rules grpo.policy_loss (per micro-batch) and replay.make_replay checked again: validate alone.
ONCE = [
    (["--grpo.adv_scale=std"], "grpo.adv_scale must be group, batch or none"),
    (["--grpo.adv_eps=1"], "grpo.adv_eps must be in [0, 1)"),
    (["--grpo.offpolicy=clip"], "grpo.offpolicy must be behaviour, decoupled or shaped"),
    (["--grpo.eps_low=1"], "grpo.eps_low must be in [0, 1)"),
    (["--grpo.eps_high=100"], "grpo.eps_high must be in [0, 100)"),
    (["--grpo.is_cap=0.5"], "grpo.is_cap must be ≥ 1"),
    (["--grpo.beta=-1"], "grpo.beta must be ≥ 0"),
    (["--grpo.engine_is_cap=0.5"], "grpo.engine_is_cap must be 0 (off) or ≥ 1"),
    (["--replay.advantage=fresh"], "replay.advantage must be stored or recompute"),
    (["--replay.rlep_source=x.jsonl"], "replay.rlep_source must be empty: it is read by rlep only"),
    (["--replay.strategy=uniform", "--replay.ratio=1"],
     "replay.ratio must be in [0, 1) for uniform"),
    (["--replay.strategy=uniform", "--replay.max_age=-1"], "replay.max_age must be ≥ 0"),
    (["--replay.strategy=aper", "--replay.ratio=5"], "replay.ratio must be in [0, 4] for aper"),
    (["--replay.strategy=aper", "--replay.alpha=100"], "replay.alpha must be in [0, 100)"),
    (["--replay.strategy=aper", "--replay.priority_eps=0"], "replay.priority_eps must be > 0"),
    (["--replay.strategy=rlep", "--replay.rlep_n=0"], "replay.rlep_n must be ≥ 1"),
    (["--replay.strategy=exgrpo", "--replay.exgrpo_sigma=0"], "replay.exgrpo_sigma must be > 0"),
    (["--replay.strategy=exgrpo", "--replay.exgrpo_min_solve=2"],
     "replay.exgrpo_min_solve must be in [0, 1]"),
    (["--replay.strategy=group", "--replay.tau_max=0"], "replay.tau_max must be ≥ 1"),
]


@pytest.mark.parametrize("overrides, message", ONCE, ids=[" ".join(o[0]) for o in ONCE])
def test_validate_checks_what_grpo_and_replay_read(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(None, overrides))


def test_strategy_keys_are_checked_by_the_strategy():
    with pytest.raises(ConfigError, match=re.escape("replay.tau_max must be ≥ 1")):
        validate(load_config(None, ["--replay.strategy=aper", "--replay.tau_max=0"]))
    validate(load_config(None, ["--replay.tau_max=0"]))  # none does not read tau_max


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu():
    with pytest.raises(ConfigError, match="cuda needs a visible GPU"):
        validate(load_config(None, ["--model.device=cuda"]))


def test_removed_keys_say_what_replaced_them():
    with pytest.raises(ConfigError,
                       match="model.dtype was removed: master weights are always float32"):
        load_config(None, ["--model.dtype=bfloat16"])


@pytest.mark.parametrize("content, message", [
    (b"seed: 1\nbase: [a.yaml, b.yaml]\n", "base must be one file name"),
    (b"seed: \xff\xfe1\n", "is not UTF-8 text"),
    (b"- 1\n- 2\n", "must hold a mapping of keys"),
    (b"seed: [1\n", "is not valid YAML"),
])
def test_bad_config_files(tmp_path, content, message):
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(f), [])


def test_yaml_alias_bomb_gives_a_short_message(tmp_path):
    lines = (["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
             + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)])
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(lines) + "\nseed: *a8\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(f), [])
    assert len(str(e.value)) < 300


def test_every_shipped_config_resolves():
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        validate(load_config(str(path), []))


def test_cli_bad_override_one_line_exit_2(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"--out_dir={out}",
         "--optim.lrr=1"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "optim.lr" in lines[0], p.stderr
    assert not out.exists()  # nothing was created
