"""The typed config: YAML overlays, dotted overrides, and errors that name the key."""

import subprocess
import sys
from pathlib import Path

import pytest

from config import Config, ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[1]


def test_defaults_yaml_then_cli(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 3\noptim:\n  lr: 0.5\nreplay:\n  strategy: uniform\n")
    cfg = load_config(str(f), ["--optim.lr=1e-5", "--replay.tau_max", "7", "--model.gradient_checkpointing=true"])
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


@pytest.mark.parametrize(
    "override, message",
    [
        ("--rollout.group_size=1", "group_size must be ≥ 2"),
        ("--rollout.batch_size=100", "multiple of rollout.group_size"),
        ("--rollout.max_new_tokens=0", "max_new_tokens must be > 0"),
        ("--optim.lr=-1e-3", "optim.lr must be > 0"),
        ("--replay.tau_max=0", "tau_max must be ≥ 1"),
    ],
)
def test_validate(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, [override]))


def test_every_shipped_config_resolves():
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        validate(load_config(str(path), []))


def test_cli_bad_override_one_line_exit_2(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"--out_dir={out}", "--optim.lrr=1"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "optim.lr" in lines[0], p.stderr
    assert not out.exists()  # nothing was created
