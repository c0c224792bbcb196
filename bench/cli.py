"""What every bench/ script checks before it starts work, in one place and by train.py's rules: bad
input is one line on stderr and exit 2 (`Parser`); a number is of its type and in its domain
(`positive_int`, `count`, `positive_float`); a comma list names known items only (`names`); a device
is one this machine has (`device`); an output never replaces a file the script does not own, nor
waits for the end of a run to find its folder missing (`Parser.check_file`, `Parser.check_folder`);
an optional dependency is installed (`Parser.need`); train.py's config and overrides pass train.py's
own checks (`Parser.check_config`). Checked up front, a bad input costs seconds, not a whole
benchmark followed by a traceback. Also what the measuring scripts share: a GPU's `sync`, the
`versions` a figure was measured on, and the process group of one that FSDP2 needs (`one_process`).

  ap = cli.Parser(__file__, __doc__)
  ap.add_argument("--rows", type=cli.positive_int, default=4)
  ap.add_argument("--json", default="", help="also write the figures here")
  ap.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
  a = ap.parse_args(argv)
  ap.check_file("--json", a.json, a.overwrite)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

# file_fault and folder_fault: support/util.py's, re-exported for the scripts and their tests
from support.util import OneLineParser, RunError, file_fault, folder_fault  # noqa: F401

INSTALL = "pip install -r bench/requirements.txt"


class Parser(OneLineParser):
    """A bench script's parser: named after its file, its docstring as the help; every error one
    line (`prog: error: ...`) and exit 2."""

    def __init__(self, script: str, doc: str | None):
        super().__init__(prog=Path(script).name, description=doc,
                         formatter_class=argparse.RawDescriptionHelpFormatter)

    def check_file(self, flag: str, path: str | None, overwrite: bool = False,
                   makes_folder: bool = False) -> None:
        """Refuse the output file `path` of `flag` (None: an optional flag not given) unless the
        script may write it (`file_fault`); an empty path is refused, not taken as none."""
        if path is None:
            return
        fault = file_fault(path, overwrite, makes_folder)
        if fault:
            self.error(f"{flag} {shown(path)} {fault}")

    def check_folder(self, flag: str, path: str | None) -> None:
        """Refuse the output folder `path` of `flag` (None: not given) unless the script can make
        or write it (`folder_fault`); an empty path is refused, not taken as the current folder."""
        if path is None:
            return
        fault = folder_fault(path)
        if fault:
            self.error(f"{flag} {shown(path)} {fault}")

    def check_config(self, path: str, overrides: list[str]):
        """The config train.py would run with `path` and `overrides`, checked as train.py checks
        it: a bad key or value is one line now, not a run that fails after the others ran."""
        from config import ConfigError, load_config, validate  # (seconds: after cheap checks)

        try:
            cfg = load_config(path, overrides)
            validate(cfg)
        except (ConfigError, RunError) as e:
            self.error(str(e))
        return cfg

    def need(self, *modules: str, install: str = INSTALL) -> None:
        """Refuse to start without every one of `modules` (looked up, not imported: milliseconds,
        before any work)."""
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            self.error(f"needs {', '.join(missing)}, not installed: {install}")


def shown(path: str) -> str:
    """`path` as an error line shows it: quoted (an empty one stays visible, a newline escaped),
    cut when no real path is that long."""
    if len(path) < 200:
        return repr(path)
    return repr(path[:100]) + "..."


def whole(text: str, low: int) -> int:
    """`text` as an integer ≥ `low`, or argparse's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be ≥ {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """A count that cannot be zero: rows, steps, repeats, threads."""
    return whole(text, 1)


def count(text: str) -> int:
    """A count where 0 means something (all layers, the default, off), as its help says."""
    return whole(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0: a budget, a peak (NaN, inf, 0 and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < math.inf:  # (NaN is not)
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return value


def names(known: tuple[str, ...] | list[str]):
    """The type of a comma list of `known` names, each at most once (a list): an unknown arm is an
    error here, not silently skipped or run as another arm after the model is built."""

    def parse(text: str) -> list[str]:
        items = text.split(",")
        for item in items:
            if item not in known:
                raise argparse.ArgumentTypeError(
                    f"unknown {item!r}; choose from {', '.join(known)}")
        if len(set(items)) < len(items):
            raise argparse.ArgumentTypeError(f"names one twice: {text}")
        return items

    return parse


def device(text: str) -> str:
    """cpu, or cuda[:N] where CUDA sees that GPU (not found out after the model is built)."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N], got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N], got {text!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: no GPU is visible (torch.cuda.is_available() "
                                         "is False)")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: only {torch.cuda.device_count()} GPU(s)")
    return text


def tokenizer_fault(vocab: int) -> str | None:
    """Why a random model of `vocab` entries cannot take the tiny tokenizer's prompts (None: it
    can): their ids reach the tokenizer's size, past the embedding."""
    from data.build_tiny_model import build_tokenizer

    size = len(build_tokenizer())
    if vocab < size:
        return f"is below the tokenizer's {size} tokens (the prompts' ids)"
    return None


def sync(device=None) -> None:
    """Wait for the GPU's queued work (a timing's edge); nothing on a CPU. `device`: the timed
    one (None: CUDA when there is one)."""
    import torch

    cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()


def versions() -> dict:
    """What a measurement ran on: torch, CUDA, triton, transformers, peft and the NVIDIA driver
    (None: not here)."""
    import torch

    found = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for module in ("triton", "transformers", "peft"):
        try:
            found[module] = importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            found[module] = None
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30, check=False)
        found["driver"] = r.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        found["driver"] = None
    return found


@contextmanager
def one_process(device):
    """A process group of one, which FSDP2 needs (unless one is set up): the trainer's backends,
    NCCL for device tensors and gloo for its host-tensor collectives."""
    import torch
    import torch.distributed as dist

    from support.parallel import backend_map

    if dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    with tempfile.TemporaryDirectory(prefix="one_process_") as folder:  # (the store may go first)
        dist.init_process_group(backend_map(device.type), init_method=f"file://{folder}/store",
                                rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
