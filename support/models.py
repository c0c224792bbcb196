"""The policy model: loading (a folder or hub id; FSDP2 or DDP, compile, LoRA, the weights read on
rank 0 alone), and saving (a model folder written aside, fsync'ed and renamed).
"""

from __future__ import annotations

import copy
import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from support import integrity, lora
from support.logprobs import head_precision
from support.lora import LoraConfig
from support.parallel import MAX, all_ranks, hf_module
from support.util import RunError, fsync, oneline, utf8_path


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
    """ddp | fsdp: how torchrun's processes share the model (FSDP2 shards weights and state)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (real models, long responses)."""
    compile: bool = False
    """torch.compile the training forward (generation stays eager; shapes vary: recompiles)."""
    head_tf32: bool = False
    """CUDA: the output layer's float32 GEMMs (the sampler's logits, the chunked log-prob pass
    and its backward) on TF32 tensor cores, the rest of the process as it was. Inputs round to
    TF32's 10-bit mantissa, which holds bf16 values exactly (bf16 compute under FSDP); products
    add in float32. The CPU ignores it."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N. auto = cuda when available (under torchrun the local rank's)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on a frozen base (lora.rank 0 = off: full fine-tuning)."""

    def check(self) -> dict[str, tuple[bool, str]]:
        cuda = self.device.startswith("cuda")
        named = self.device in ("auto", "cpu") or cuda
        dtype_ok = self.compute_dtype in ("float32", "bfloat16")
        return {"compute_dtype": (dtype_ok, "float32 or bfloat16"),
                "parallel": (self.parallel in ("ddp", "fsdp"), "ddp or fsdp"),
                "device": (named and (not cuda or torch.cuda.is_available()),
                           "auto, cpu or cuda[:N], and cuda needs a visible GPU")}


def load_pretrained(path: str, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
               meta: bool = False):
    """(model, tokenizer) from a local folder or hub id. Code shipped in the folder runs only with
    trust_remote_code; weights load from safetensors (transformers refuses pickled .bin files unless
    they load with weights_only). `meta`: the model is built on the meta device, without memory or
    weights (fill_from_rank0 brings them)."""
    transformers.utils.logging.disable_progress_bar()  # one line per run, not a bar per file
    if not Path(path).exists():  # a hub id
        integrity.refuse(hub_fault(path))
    folder = sorted(Path(path).iterdir()) if Path(path).is_dir() else []
    for f in folder:  # a FIFO would block its reader forever
        if not (f.is_file() or f.is_dir()):
            raise ValueError(f"{f.name} is not a regular file (a pipe, device, broken link)")
    with utf8_path(path) as name:  # (a path the locale could not decode: Rust opens it too)
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    kw = {"trust_remote_code": trust_remote_code, "dtype": dtype}
    if meta:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **kw)
        try:  # what from_pretrained would have read
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass  # none saved: from_config's, made from the model config, as from_pretrained's is
    else:
        model = whole_model(path, kw)
    integrity.refuse(integrity.tokenizer_fault(tokenizer, model, path))
    return model.eval(), tokenizer


def whole_model(path: str, kw: dict):
    """from_pretrained, refused (RunError) unless every tensor of the architecture was in the
    folder in its shape and nothing else was: transformers would initialise a missing one at
    random and only print a report."""
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                       ignore_mismatched_sizes=True, **kw)
    integrity.refuse(integrity.weights_fault(info))
    return model


def fill_from_rank0(model, path: str, device: torch.device, trust_remote_code: bool,
                    dtype: torch.dtype) -> None:
    """Storage on `device` for a model built on the meta device (FSDP-sharded or whole), and the
    weights of `path`: rank 0 alone reads them onto its host, torch's helper sends each rank its
    shards (or the whole tensors), so a node holds one host copy of the model, not one per process.
    Buffers outside the state dict (RoPE's inv_freq) are rank 0's too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    if not isinstance(model, FSDPModule):  # to_empty untied shared weights (FSDP keeps them tied)
        model.tie_weights()
    full, fault = None, ""
    if dist.get_rank() == 0:
        try:
            full = whole_model(path, {"trust_remote_code": trust_remote_code, "dtype": dtype})
        except Exception as e:  # refused on every rank, below
            fault = oneline(e)
    if all_ranks(float(bool(fault)), MAX):
        raise RunError(fault or "refused by rank 0, which reads the weights")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full.state_dict() if full is not None else {}, options=options)
    for name, buffer in model.named_buffers():
        if full is not None:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, 0)


def checkpoint_activations(model) -> None:
    """Recompute activations in the backward pass (transformers 5.2x renames the method)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()


def load_run_model(cfg, path: str, world: int, ck: Path | None) -> tuple:
    """(device, load_policy's modules) of a run (cfg is config.Config); a missing, corrupt or
    foreign model folder is one line."""
    local = path.startswith((".", "/", "~")) or Path(path).parent.is_dir()
    hub_id = path.count("/") == 1 and not local
    if not Path(path).exists() and not hub_id:
        raise RunError(f"model.path {path} does not exist (a local folder or an org/name hub id)")
    local_gpu = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    device = torch.device(local_gpu if cfg.model.device == "auto" else cfg.model.device)
    what = "checkpoint" if ck else "model.path"
    try:
        return device, load_policy(cfg, path, device, world)
    except RunError as e:  # ours: it says what is wrong
        raise RunError(f"{what} {path}: {e}") from None
    except Exception as e:
        raise RunError(f"{what} {path}: {type(e).__name__}: {oneline(e)}") from None


def hub_fault(repo: str) -> str | None:
    """Why hub id `repo` cannot be fetched, found by at most one request (None: it is in the local
    cache, or the hub answered): offline (HF_HUB_OFFLINE), or the hub out of reach. transformers
    would retry each file five times first, a line per try, for about a minute."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    try:
        if isinstance(try_to_load_from_cache(repo, "config.json"), str):
            return None
    except HFValidationError:
        return None  # not a hub id after all: transformers says what it is not
    where = "a hub id not in the local Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        return f"{where}, and HF_HUB_OFFLINE is set: download it where there is network"
    try:
        HfApi().model_info(repo, timeout=10)
    except (HfHubHTTPError, HFValidationError):
        return None  # the hub answered (no such model, gated, private): transformers says so
    except Exception as e:  # no answer: the HTTP client's own errors (DNS, refused, timeout)
        return (f"{where}, and the hub cannot be reached ({type(e).__name__}: "
                f"{oneline(e, 80)}): give a local folder, or set HF_HUB_OFFLINE=1 once cached")
    return None


def load_policy(cfg, path: str, device: torch.device, world: int):
    """The model to train (cfg is config.Config): (model, policy, tokenizer, ref, compute).

    `model`: the HF module, float32 master weights, sharded in place under FSDP (a unit per decoder
    layer, then the root); generation, no-grad passes and saving use it. `policy`: what the training
    forward goes through (model, compiled, or DDP-wrapped). `compute`: bf16 autocast when bf16
    compute is on without FSDP (FSDP casts through its mixed-precision policy). `ref`: the frozen KL
    reference (beta > 0), bf16 with bf16 compute. Under LoRA `model` is the peft-wrapped base from
    model.path with the adapters of checkpoint `path` (fresh when it has none), `ref` the same
    module with its adapters off."""
    bf16 = cfg.model.compute_dtype == "bfloat16"
    fsdp = cfg.model.parallel == "fsdp" and dist.is_initialized()  # torchrun, even of one process
    adapted = cfg.model.lora.rank > 0
    base_dtype = torch.bfloat16 if bf16 and adapted else torch.float32
    trust = cfg.model.trust_remote_code
    meta = world > 1 and not adapted  # rank 0 reads weights
    model, tokenizer = load_pretrained(cfg.model.path if adapted else path, trust, base_dtype, meta)
    if cfg.model.gradient_checkpointing:
        checkpoint_activations(model)
        model.config.use_cache = False
    ref = None
    ref_dtype = torch.bfloat16 if bf16 else torch.float32
    if cfg.grpo.beta > 0 and not adapted:
        ref = load_pretrained(cfg.model.path, trust, ref_dtype, meta)[0]
    if adapted:
        saved = path if Path(path, "adapter_config.json").is_file() else None
        model = lora.add_adapters(model, cfg.model.lora, cfg.seed, saved)
    if cfg.model.head_tf32:  # (the CPU ignores it)
        for module in [m for m in (model, ref) if m is not None]:
            head_precision(module, tf32=True)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=torch.float32)
    for module, source, dtype in [(model, path, torch.float32), (ref, cfg.model.path, ref_dtype)]:
        if module is None:
            continue
        root = hf_module(module)  # under LoRA the module inside peft's wrapper (generate's)
        if fsdp:
            layers = root._no_split_modules or []
            units = [unit for unit in root.modules() if type(unit).__name__ in layers]
            for unit in units + [root]:
                fully_shard(unit, mp_policy=mp)
        if meta:
            fill_from_rank0(module, source, device, trust, dtype)
        elif not fsdp:
            module.to(device)
    if ref is not None:
        ref.requires_grad_(False).eval()
    if cfg.grpo.beta > 0 and adapted:
        ref = lora.AdaptersOff(model)
    policy = torch.compile(model) if cfg.model.compile else model
    if world > 1 and not fsdp:  # buffers never change: forwards need no broadcast
        ids = None if device.index is None else [device.index]
        policy = torch.nn.parallel.DistributedDataParallel(policy, device_ids=ids,
                                                           broadcast_buffers=False)
    compute = nullcontext()
    if bf16 and not fsdp:
        compute = torch.autocast(device.type, dtype=torch.bfloat16)
    return model, policy, tokenizer, ref, compute


def save_model(model, tokenizer, folder: Path, state: dict | None = None,
               optimizer: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """Every rank: write an HF model folder (safetensors gathered from FSDP shards, in `dtype`,
    default the float32 master weights; the tokenizer), rank 0 the `optimizer` state (optimizer.pt),
    and each rank its trainer state to a temporary folder, fsync every file, then rank 0 a
    checkpoint's manifest (support/integrity.py), last, and rename it to `folder`. A failure on
    any rank (a full disk raises OSError, SafetensorError or RuntimeError alike) removes it and
    raises OSError on every rank."""
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    tmp = folder.with_name(f".tmp_{folder.name}")
    error = ""
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if distributed:
            dist.barrier()
        write_weights(model, tokenizer, tmp, rank, state is None, dtype)
        if rank == 0 and optimizer is not None:
            torch.save(optimizer, tmp / "optimizer.pt")
        own = []  # each rank syncs its own files: the others may still be writing theirs
        if state is not None:
            own.append(tmp / f"state_rank{rank}.pt")
            torch.save(state, own[0])
        if rank == 0:  # (and HF's temporary files come and go)
            own += [f for f in tmp.rglob("*") if not f.name.startswith("state_rank")]
        for f in own:
            fsync(f)
    except Exception as e:  # reported below, on every rank
        error = f"{type(e).__name__}: {oneline(e, 160)}"
    fail_together(error, rank, tmp, folder)
    if rank == 0 and state is not None:  # last, once every rank's files are written
        try:
            integrity.write_manifest(tmp)
        except OSError as e:
            error = f"{type(e).__name__}: {oneline(e, 160)}"
    fail_together(error, rank, tmp, folder)
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)  # there when a resumed run redoes its last step
        os.replace(tmp, folder)
        fsync(folder.parent)
    if distributed:
        dist.barrier()


def fail_together(error: str, rank: int, tmp: Path, folder: Path) -> None:
    """OSError on every rank when one failed (`error`: this rank's), the temporary folder gone."""
    if not all_ranks(float(bool(error)), MAX):
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise OSError(f"{folder} could not be written ({error or 'on another rank'})")


def write_weights(model, tokenizer, folder: Path, rank: int, final: bool,
                  dtype: torch.dtype | None = None) -> None:
    """The model folder's files (every rank calls it; rank 0 writes): safetensors gathered from FSDP
    shards (in `dtype`, default the float32 master weights) and the tokenizer; under LoRA the
    adapters, and in final/ the merged model too (lora.save_adapted)."""
    if lora.is_adapted(model):
        lora.save_adapted(model, tokenizer, folder, rank, merged=final)
        return
    weights = model.state_dict()
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
    if rank == 0:
        save_weights(model, tokenizer, folder, weights, dtype)


def save_weights(model, tokenizer, folder: Path, weights: dict, dtype: torch.dtype | None) -> None:
    """save_pretrained of `weights`, floating tensors cast to `dtype` (tied ones stay one tensor)
    and the config saying so, so from_pretrained(dtype="auto") loads them as they are."""
    cast = {}
    for k, v in weights.items():
        if dtype is None or not v.is_floating_point():
            continue
        if v.data_ptr() not in cast:
            cast[v.data_ptr()] = v.to(dtype)
        weights[k] = cast[v.data_ptr()]
    model.save_pretrained(folder, state_dict=weights)
    if dtype is not None:  # save_pretrained wrote the dtype of the weights in memory
        config = copy.deepcopy(model.config)
        config.dtype = dtype
        config.save_pretrained(folder)
    with utf8_path(folder) as name:
        tokenizer.save_pretrained(name)
