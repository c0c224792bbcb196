"""Reading a config's text: YAML files (a `base:` chain) and command-line values, as config.py's
typed fields take them. Every fault is a ConfigError naming the key or file.
"""

from __future__ import annotations

import os
import reprlib
from pathlib import Path

from data.loaders import read_yaml_file
from support.util import flatten, printable, text_fault

MAX_BASES = 16  # files in one `base:` chain


class ConfigError(ValueError):
    """A bad config key, value or file: train.py prints it on one line and exits 2."""

    def __str__(self) -> str:
        return printable(ValueError.__str__(self))  # a file name may hold a newline


BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
CONVERTS = {int: (str,), float: (str, int), str: (int, float)}  # a field's type: from these
SHORT = reprlib.Repr()  # values in messages stay short (a YAML alias bomb would print megabytes)
SHORT.maxstring = SHORT.maxother = 60
SHORT.maxlist = SHORT.maxdict = 4
SHORT.maxlevel = 2

# Keys naming a file or folder: bytes the locale cannot decode stay as Python spells them (below).
PATHS = ("out_dir", "model.path", "data.train", "data.eval", "data.data_dir", "replay.module",
         "replay.rlep_source")


def parse_value(key: str, value, tp):
    """`value` as the field's type `tp` (command-line strings are parsed), or a ConfigError."""
    if isinstance(value, str):
        value = _text(key, value)
    if isinstance(value, list):
        value = [_text(key, v) if isinstance(v, str) else v for v in value]
    if isinstance(value, str) and tp is bool and value.lower() in BOOLS:
        return BOOLS[value.lower()]
    if isinstance(value, str) and tp == list[str]:  # --rollout.stop_tokens=a,b
        return [v for v in value.split(",") if v]
    if type(value) in CONVERTS.get(tp, ()):
        try:
            return tp(value)
        except (ValueError, OverflowError):  # int("1.5"), float(10**400)
            pass
    if type(value) is tp:
        return value
    if tp == list[str] and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ConfigError(f"config key {key} expects {getattr(tp, '__name__', tp)}, "
                      f"got {SHORT.repr(value)}")


def _text(key: str, text: str) -> str:
    """`text` as config key `key` takes it, or a ConfigError: no tokenizer or file takes a lone
    surrogate (\\ud800). Under a locale whose encoding is not UTF-8 (LC_ALL=C), Python reads each
    byte of the command line it cannot decode as a surrogate U+DC80-U+DCFF: a path keeps that
    spelling (the file system's bytes; os.fsencode gives them back), other text is those bytes
    read as UTF-8."""
    if not text_fault(text):
        return text
    try:
        raw = os.fsencode(text)  # (fails unless every surrogate stands for a byte)
        return text if key in PATHS else raw.decode("utf-8")
    except UnicodeError:
        raise ConfigError(f"config key {key}: its text {text_fault(text)}") from None


def read_yaml(path: str | Path, seen: tuple = ()) -> dict:
    """Flat {dotted key: value} of a YAML file; a top-level `base: other.yaml` (relative to it) is
    read first. Its loading is bounded (data.loaders.read_yaml_file)."""
    p = Path(path)
    if p.resolve() in seen:
        raise ConfigError(f"config file {path} includes itself through `base`")
    if len(seen) >= MAX_BASES:
        raise ConfigError(f"config file {path}: a `base` chain of more than {MAX_BASES} files")
    try:
        data = read_yaml_file(p) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"config file {' '.join(str(e).split())[:300]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, "
                          f"not {type(data).__name__}")
    bad = _bad_key(data)
    if bad:
        raise ConfigError(f"config file {path}: keys must be names, got {bad}")
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"config file {path}: base must be one file name, got {SHORT.repr(base)}")
    flat = read_yaml(p.parent / base, (*seen, p.resolve())) if base else {}
    return flat | flatten(data)


def _bad_key(data: dict, prefix: str = "") -> str | None:
    """The first key of a YAML mapping (nested ones included) that is not text, as a message: YAML
    reads `1:`, `~:` or `yes:` as an integer, null or bool, which no dotted key can name."""
    for key, value in data.items():
        if not isinstance(key, str):
            return f"{SHORT.repr(key)} ({type(key).__name__}) in {prefix or 'the top level'}"
        if isinstance(value, dict):
            bad = _bad_key(value, f"{prefix}{key}.")
            if bad:
                return bad
    return None
