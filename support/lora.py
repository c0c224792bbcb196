"""LoRA adapters on a frozen base (model.lora.rank > 0), through peft, imported only then.

The base weights stay in the compute dtype and never get gradients or optimizer state; the
adapters (A, B per targeted linear layer: W x + alpha/r · B A x) and their AdamW state are
float32. B starts at 0, so the adapted model starts as the base. The KL reference is the same
module with its adapters switched off (`AdaptersOff`), not a second copy. Checkpoints hold the
adapters alone; final/ holds the merged model and the adapter folder (final/adapter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from support.parallel import full_tensor
from support.util import utf8_path

ADAPTER = "default"  # peft's name for a model's one adapter


@dataclass
class LoraConfig:
    rank: int = 0
    """Adapter rank r (0 = off: every weight is trained)."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input in training forwards (none in generation, no-grad passes)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Layers with adapters: all-linear (all but the LM head) or names like q_proj,v_proj."""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"rank": (self.rank >= 0, "≥ 0 (0 = off)"), "alpha": (self.alpha > 0, "> 0"),
                "dropout": (0 <= self.dropout < 1, "in [0, 1)"),
                "target_modules": (len(self.target_modules) > 0, "all-linear or module names")}


def add_adapters(model, cfg: LoraConfig, seed: int, saved: str | None = None):
    """`model` (frozen from here on) wrapped by peft with float32 adapters: those saved in folder
    `saved`, else fresh ones whose random A comes from `seed` alone (the same on every rank)."""
    import peft
    from safetensors.torch import load_file

    targets = "all-linear" if cfg.target_modules == ["all-linear"] else cfg.target_modules
    spec = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=targets, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = peft.get_peft_model(model, spec, autocast_adapter_dtype=True)
    if saved is not None:
        weights = load_file(Path(saved) / "adapter_model.safetensors")
        result = peft.set_peft_model_state_dict(model, weights, adapter_name=ADAPTER)
        if result.unexpected_keys or len(weights) != len(adapter_weights(model)):
            raise ValueError(f"{saved}: its adapters do not fit model.lora (rank, target_modules)")
    return model


def is_adapted(model) -> bool:
    return hasattr(model, "peft_config")


class AdaptersOff:
    """The KL reference under LoRA: the policy's own module with its adapters switched off, which
    is exactly the frozen base (no second copy of the model is loaded)."""

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return self.model.parameters()

    def __call__(self, **inputs):
        with self.model.disable_adapter():
            return self.model(**inputs)


def adapter_weights(model) -> dict[str, torch.Tensor]:
    """{name: whole float32 tensor on the CPU} of the adapters, named as peft's save expects."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = full_tensor(p.detach()).cpu()
    return out


def merged_weights(model):
    """Yields (name, tensor) of every weight of the adapted model with its adapters merged in
    (W + alpha/r · B A, summed in float32, in the base's dtype), named as in the base model's own
    folder, one tensor at a time: no second copy of the model is held (an inference engine's
    weight sync, final/). Under FSDP every rank must run the whole iteration: each weight is
    gathered in turn."""
    base = model.get_base_model()
    layers = {n: m for n, m in base.named_modules() if hasattr(m, "lora_A") and ADAPTER in m.lora_A}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        tensor = full_tensor(value.detach())
        if owner and leaf == "weight":
            m = layers[owner]
            a = full_tensor(m.lora_A[ADAPTER].weight.detach())  # (r, in)
            b = full_tensor(m.lora_B[ADAPTER].weight.detach())  # (out, r)
            delta = m.scaling[ADAPTER] * (b.float() @ a.float())  # (out, in)
            tensor = (tensor.float() + delta).to(tensor.dtype)
        yield (f"{owner}.{leaf}" if owner else key), tensor


def save_adapted(model, tokenizer, folder: Path, rank: int, merged: bool) -> None:
    """Write the adapter folder into `folder` (a checkpoint), or with `merged` the merged model
    into `folder` and the adapter folder into folder/adapter (final/). Every rank calls it; rank 0
    writes."""
    adapters = adapter_weights(model)
    if rank == 0:
        model.save_pretrained(folder / "adapter" if merged else folder, state_dict=adapters)
        with utf8_path(folder) as name:  # (a path the locale could not decode: Rust writes too)
            tokenizer.save_pretrained(name)
    if not merged:
        return
    weights = {}
    for name, tensor in merged_weights(model):
        if rank == 0:
            weights[name] = tensor.cpu()
    if rank == 0:
        model.get_base_model().save_pretrained(folder, state_dict=weights)
