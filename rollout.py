"""The policy model and its rollouts: loading and saving (for train.py and eval.py), prompts as
token ids, and G completions per prompt from Hugging Face `generate` with their behaviour log-probs.

A batch of rollouts is one `Rollouts`: every row is `prompt | completion | right padding`, so the
training forward needs no position-id tricks and the replay buffer stores a row as it is.

Our config alone defines what is sampled (temperature, top-p, top-k): the model's generation_config
is set aside for the call, so the loss's log-probs describe the distribution sampled. One logits
processor applies it and records the behaviour log-probs and the sampling entropy: no extra pass.
A completion ends at its first end token (kept: the model must learn to stop), any of `end_ids`;
`truncated` means none came within max_new_tokens.
"""

from __future__ import annotations

import copy
import os
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

import jinja2
import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)

import grpo
import lora
from preempt import Interrupted, should_stop
from util import oneline


@dataclass
class RolloutConfig:
    batch_size: int = 256
    """Fresh rollouts generated per step (= prompts per step × group_size)."""
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are relative within a group."""
    max_new_tokens: int = 48
    """Generation length cap; a completion that reaches it without an end token is truncated."""
    temperature: float = 1.0
    """Sampling temperature; log-probs in the loss use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; behaviour log-probs are of the truncated distribution actually sampled."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = off); log-probs are of that distribution."""
    gen_batch_size: int = 256
    """Sequences per HF `generate` call (memory knob; a call may mix several prompts' groups)."""
    stop_tokens: list[str] = field(default_factory=list)
    """Extra end tokens (each one token of the vocabulary), besides eos and the end of turn."""
    mask_truncated: bool = False
    """Leave truncated rows out of the loss (DAPO's overlong filtering); their group counts them."""
    dynamic_sampling: int = 0
    """DAPO's dynamic sampling: up to this many generation rounds a step, keeping groups with a
    reward spread."""
    engine: str = "hf"
    """What samples: `hf` (HF generate, the reference loop) or `vllm` (vllm_engine.py)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm, GPU: share of GPU memory the engine may take for weights and KV cache (vLLM's)."""
    vllm_kv_cache_gb: float = 0.0
    """vllm: KV cache in GiB (0 = from vllm_gpu_memory_utilization on a GPU, 1 GiB on a CPU)."""
    vllm_sleep: bool = True
    """vllm, GPU: sleep mode (KV cache freed, weights offloaded) during the update; CPU: no-op."""

    def check(self) -> dict[str, tuple[bool, str]]:
        G, n = self.group_size, self.batch_size
        return {
            "group_size": (G >= 2, "≥ 2 (GRPO compares completions in a group)"),
            "batch_size": (n > 0 and G > 0 and n % G == 0,
                           f"a positive multiple of rollout.group_size ({G})"),
            "max_new_tokens": (self.max_new_tokens > 0, "> 0"),
            "temperature": (0 < self.temperature < 1e6, "> 0"),
            "top_p": (0 < self.top_p <= 1, "in (0, 1]"),
            "top_k": (self.top_k >= 0, "≥ 0 (0 = off)"),
            "gen_batch_size": (self.gen_batch_size > 0, "> 0"),
            "dynamic_sampling": (self.dynamic_sampling >= 0, "≥ 0 (0 = off)"),
            "engine": (self.engine in ("hf", "vllm"), "hf or vllm"),
            "vllm_gpu_memory_utilization": (0 < self.vllm_gpu_memory_utilization <= 1, "in (0, 1]"),
            "vllm_kv_cache_gb": (0 <= self.vllm_kv_cache_gb < 1e6, "≥ 0 (0 = automatic)"),
        }


FLOAT_FIELDS = ("reward", "advantage", "entropy")  # of the per-row fields
BOOL_FIELDS = ("truncated", "correct", "replayed", "onpolicy")  # (the others are int64)


@dataclass
class Rollouts:
    """B sequences, each `prompt | completion | pad`, right-padded to length L. `behav_logp[b, t]`
    is log μ(tokens[b, t] | tokens[b, :t]), 0 outside the completion; the per-row fields say where
    it came from and how it scored."""

    tokens: torch.Tensor  # (B, L) int64, pad id after seq_len
    prompt_len: torch.Tensor  # (B,) int64, number of prompt tokens (the completion starts there)
    seq_len: torch.Tensor  # (B,) int64, prompt + completion tokens (the end token included)
    behav_logp: torch.Tensor  # (B, L) float32, behaviour-policy log-prob of each completion token
    truncated: torch.Tensor  # (B,) bool, hit max_new_tokens before any end token
    prompt_idx: torch.Tensor  # (B,) int64, index of the prompt in the training set
    group: torch.Tensor  # (B,) int64, rows with the same id share a prompt: one GRPO group
    born: torch.Tensor  # (B,) int64, training step at which the row was generated
    reward: torch.Tensor  # (B,) float32, scalar reward (rewards.py, plus overlong shaping when on)
    correct: torch.Tensor  # (B,) bool, verified-correct final answer
    advantage: torch.Tensor  # (B,) float32, group-relative advantage (grpo.group_advantages)
    entropy: torch.Tensor  # (B,) float32, mean token entropy of the distribution sampled from
    replayed: torch.Tensor  # (B,) bool, came from the replay buffer, not this step's generation
    onpolicy: torch.Tensor  # (B,) bool, behaviour log-probs are the current policy's (fresh, RLEP)
    slot: torch.Tensor  # (B,) int64, the replay buffer row a replayed row came from; -1 if fresh

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def empty(B: int, L: int, pad_id: int) -> Rollouts:
        """B blank rows of length L: pad tokens, zeros, False, slot -1."""
        rows = {}
        for f in fields(Rollouts):
            dtype = torch.float32 if f.name in FLOAT_FIELDS else torch.long
            if f.name in BOOL_FIELDS:
                dtype = torch.bool
            rows[f.name] = torch.full((B,), -(f.name == "slot"), dtype=dtype)
        rows["tokens"] = torch.full((B, L), pad_id)
        rows["behav_logp"] = torch.zeros(B, L)
        return Rollouts(**rows)

    @property
    def completion_len(self) -> torch.Tensor:  # (B,)
        return self.seq_len - self.prompt_len

    def completion_mask(self) -> torch.Tensor:  # (B, L) bool
        t = torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :]
        return (t >= self.prompt_len[:, None]) & (t < self.seq_len[:, None])

    def select(self, idx: torch.Tensor) -> Rollouts:
        """Rows `idx` (index tensor or bool mask), trimmed to their longest sequence."""
        rows = {f.name: getattr(self, f.name)[idx] for f in fields(self)}
        L = int(rows["seq_len"].max()) if len(rows["seq_len"]) else 1
        rows["tokens"] = rows["tokens"][:, :L]
        rows["behav_logp"] = rows["behav_logp"][:, :L]
        return Rollouts(**rows)

    @staticmethod
    def cat(parts: list[Rollouts], pad_id: int) -> Rollouts:
        """Stack rows of several batches, right-padding token tensors to the longest."""
        L = max(p.tokens.shape[1] for p in parts)
        rows = {}
        for f in fields(Rollouts):
            values = [getattr(p, f.name) for p in parts]
            if values[0].dim() == 2:  # (b, l) -> (b, L)
                fill = pad_id if f.name == "tokens" else 0
                values = [torch.nn.functional.pad(v, (0, L - v.shape[1]), value=fill)
                          for v in values]
            rows[f.name] = torch.cat(values)
        return Rollouts(**rows)


class Row(NamedTuple):
    """One sampled sequence, as `pack` takes it."""

    ids: list[int]  # prompt + completion token ids
    prompt_len: int
    logp: list[float] | torch.Tensor  # behaviour log-prob of each completion token
    truncated: bool  # no end token came within max_new_tokens
    entropy: float  # mean token entropy of the distribution sampled


def pack(rows: list[Row], pad_id: int, prompt_idx: torch.Tensor, group: torch.Tensor,
         step: int) -> Rollouts:
    """`rows` as one on-policy Rollouts born at `step`."""
    ro = Rollouts.empty(len(rows), max(len(row.ids) for row in rows), pad_id)
    for b, row in enumerate(rows):
        end = len(row.ids)
        ro.tokens[b, :end] = torch.as_tensor(row.ids)
        ro.behav_logp[b, row.prompt_len : end] = torch.as_tensor(row.logp)
        ro.prompt_len[b] = row.prompt_len
        ro.seq_len[b] = end
        ro.truncated[b] = bool(row.truncated)
        ro.entropy[b] = row.entropy
    ro.prompt_idx = prompt_idx.long()
    ro.group = group.long()
    ro.born[:] = step
    ro.onpolicy[:] = True
    return ro


def pack_groups(rows: list[Row], tokenizer, counts: list[int], prompt_idx, step: int,
                group0: int | None) -> tuple[Rollouts, list[str]]:
    """Both engines' result: `rows` (counts[i] adjacent rows of prompt i) packed, one group id per
    prompt counted from `group0` (default step × prompts), and each completion's text before its
    end token."""
    n = len(counts)
    group = (step * n if group0 is None else group0) + torch.arange(n)
    idx = torch.tensor(prompt_idx if prompt_idx is not None else range(n))
    reps = torch.tensor(counts)
    texts = []
    for row in rows:
        completion = row.ids[row.prompt_len : len(row.ids) - (not row.truncated)]
        texts.append(tokenizer.decode(completion, skip_special_tokens=True))
    group = group.repeat_interleave(reps)
    return pack(rows, tokenizer.pad_token_id, idx.repeat_interleave(reps), group, step), texts


def load_model(path: str, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
               meta: bool = False):
    """(model, tokenizer) from a local folder or hub id. Code shipped in the folder runs only with
    trust_remote_code; weights load from safetensors (transformers refuses pickled .bin files unless
    they load with weights_only). `meta`: the model is built on the meta device, without memory or
    weights (fill_from_rank0 brings them)."""
    transformers.utils.logging.disable_progress_bar()  # one line per run, not a bar per file
    folder = sorted(Path(path).iterdir()) if Path(path).is_dir() else []
    for f in folder:  # a FIFO would block its reader forever
        if not (f.is_file() or f.is_dir()):
            raise ValueError(f"{f.name} is not a regular file (a pipe, device, broken link)")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    kw = {"trust_remote_code": trust_remote_code, "dtype": dtype}
    if not meta:
        return AutoModelForCausalLM.from_pretrained(path, **kw), tokenizer
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kw)
    try:  # what from_pretrained would have read
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass  # none saved: from_config's, made from the model config, as from_pretrained's would be
    return model.eval(), tokenizer


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
    full = None
    if dist.get_rank() == 0:
        kw = {"trust_remote_code": trust_remote_code, "dtype": dtype}
        full = AutoModelForCausalLM.from_pretrained(path, **kw)
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
    model, tokenizer = load_model(cfg.model.path if adapted else path, trust, base_dtype, meta)
    if cfg.model.gradient_checkpointing:
        checkpoint_activations(model)
        model.config.use_cache = False
    ref = None
    ref_dtype = torch.bfloat16 if bf16 else torch.float32
    if cfg.grpo.beta > 0 and not adapted:
        ref = load_model(cfg.model.path, trust, ref_dtype, meta)[0]
    if adapted:
        saved = path if Path(path, "adapter_config.json").is_file() else None
        model = lora.add_adapters(model, cfg.model.lora, cfg.seed, saved)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=torch.float32)
    for module, source, dtype in [(model, path, torch.float32), (ref, cfg.model.path, ref_dtype)]:
        if module is None:
            continue
        root = lora.hf_model(module)  # under LoRA the module inside peft's wrapper (generate's)
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
    and each rank its trainer state to a temporary folder, fsync every file, rename it to `folder`.
    A failure on any rank (a full disk raises OSError, SafetensorError or RuntimeError alike)
    removes it and raises OSError on every rank."""
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
    failed = torch.tensor(float(bool(error)))
    if distributed:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"{folder} could not be written ({error or 'on another rank'})")
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)  # there when a resumed run redoes its last step
        os.replace(tmp, folder)
        fsync(folder.parent)
    if distributed:
        dist.barrier()


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
    tokenizer.save_pretrained(folder)


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


@contextmanager
def full_weights(model, compute):
    """Generation with whole weights: under FSDP they are gathered once (in bf16 with bf16 compute)
    and stay for every token of the phase, then are freed, so no collective runs while ranks
    generate different lengths. Each module's reshard-after-forward setting is restored as found
    (FSDP2 keeps the root unsharded after forward: the training backward needs its weights at once,
    and resharding it would cost one more all-gather per backward)."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if sharded:  # the root's first forward would settle its setting: settle it now, then read it
        sharded[0]._get_fsdp_state()._lazy_init()
    found = [_reshard_setting(m) for m in sharded]
    for m in sharded:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        with compute:
            yield
    finally:
        for m, setting in zip(sharded, found):
            _restore_reshard_setting(m, setting)
            m.reshard()


def _reshard_setting(module) -> tuple:
    """FSDP2's reshard-after-forward state of `module` (its API sets it but cannot read it)."""
    state = module._get_fsdp_state()
    meshes = [g.post_forward_mesh_info for g in state._fsdp_param_groups]
    return state._auto_reshard_after_forward, meshes


def _restore_reshard_setting(module, setting: tuple) -> None:
    state = module._get_fsdp_state()
    state._auto_reshard_after_forward = setting[0]
    for group, mesh_info in zip(state._fsdp_param_groups, setting[1]):
        group.post_forward_mesh_info = mesh_info


class ChatTemplateError(ValueError):
    """The tokenizer's chat template failed on a prompt: `said` is what it said (or why it failed),
    `system` whether the conversation had a system turn. train.py and eval.py name the model and the
    setting to change."""

    def __init__(self, said: str, system: bool):
        super().__init__(said)
        self.said = said
        self.system = system


def render_chat(tokenizer, turns: list[dict]) -> str:
    """The chat template applied to `turns` (a generation prompt added), or ChatTemplateError."""
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # raise_exception(), a syntax error, whatever the template's code raises
        words = oneline(e, 200)
        if isinstance(e, jinja2.TemplateSyntaxError):
            said = f"does not parse ({words}, line {e.lineno})"
        elif type(e) is jinja2.TemplateError:  # what the template's raise_exception('...') raises
            said = f"refuses the conversation: {words!r}"
        else:
            said = f"fails ({type(e).__name__}: {words})"
        syntax = isinstance(e, jinja2.TemplateSyntaxError)  # fails whatever the turns
        raise ChatTemplateError(said, turns[0]["role"] == "system" and not syntax) from e


def template_warnings(tokenizer, system_prompt: str) -> list[str]:
    """What the chat template silently leaves out of a probe conversation (the system turn, the
    user's text): the model would never see it. ChatTemplateError if the template fails on it."""
    if not tokenizer.chat_template:
        return []
    user = "What is 12+30? (a probe of the chat template)"
    turns = []
    if system_prompt.strip():
        turns.append({"role": "system", "content": system_prompt})
    text = render_chat(tokenizer, turns + [{"role": "user", "content": user}])
    said = []
    if turns and system_prompt.strip() not in text:
        said.append("leaves out the system turn")
    if user not in text:
        said.append("leaves out the user's text")
    return said


def prompt_ids(tokenizer, problem: str, template: str, chat: bool,
               system_prompt: str = "") -> list[int]:
    """Token ids of one prompt: `template` with {problem} replaced (plain text: other braces stay),
    wrapped in the tokenizer's chat template when `chat` and it has one, `system_prompt` as a system
    turn when set. A chat template writes its own BOS; plain text gets the tokenizer's special
    tokens (BOS where it adds one)."""
    text = template.replace("{problem}", problem)
    chat = chat and bool(tokenizer.chat_template)
    if chat:
        turns = []
        if system_prompt:
            turns.append({"role": "system", "content": system_prompt})
        turns.append({"role": "user", "content": text})
        text = render_chat(tokenizer, turns)
    return tokenizer(text, add_special_tokens=not chat)["input_ids"]


def build_prompts(tokenizer, problems: list, data, limit: int) -> tuple[list[list[int]], list, int]:
    """(prompt ids, problems kept, number dropped): prompts over `limit` tokens are dropped, as verl
    does. `data` is config.DataConfig; a problem's own system turn is used unless
    data.system_prompt is set. No tokenizer packs 32 characters into a token, so longer texts are
    not even tokenized."""
    prompts, kept = [], []
    for p in problems:
        if len(p.problem) > 32 * limit:
            continue
        system = data.system_prompt or p.system
        ids = prompt_ids(tokenizer, p.problem, data.template, data.chat_template, system)
        if len(ids) <= limit:
            prompts.append(ids)
            kept.append(p)
    return prompts, kept, len(problems) - len(kept)


def end_of_turn(tokenizer) -> int | None:
    """The special token a chat template writes right after an assistant turn (<|im_end|>, ...)."""
    turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "MARK"}]
    try:
        after = tokenizer.apply_chat_template(turns, tokenize=False).rsplit("MARK", 1)[1]
        ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    except Exception:  # a template that refuses this conversation gives no end of turn to learn
        return None
    if ids and ids[0] in tokenizer.all_special_ids:
        return ids[0]
    return None


def end_ids(tokenizer, model, chat: bool, stop_tokens: list[str]) -> list[int]:
    """Every token that ends a completion: the tokenizer's eos, any id of the model's
    generation_config.eos_token_id, the chat template's end of turn when it is applied, and
    `stop_tokens` (ValueError for one that is not a token)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tokenizer.eos_token_id}
    ids.update(eos if isinstance(eos, list) else [eos])
    if chat:
        ids.add(end_of_turn(tokenizer))
    for token in stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        known = isinstance(token_id, int) and token_id != tokenizer.unk_token_id
        if not known or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise ValueError(f"rollout.stop_tokens: {token!r} is not a single token of this "
                             "tokenizer")
        ids.add(token_id)
    return sorted(i for i in ids if i is not None)


class _SamplingDistribution(LogitsProcessor):
    """Turns logits into the sampling distribution (÷ temperature, cut to top-k and to the top-p
    nucleus) and records the log-probability of each sampled token under it (the behaviour log-prob)
    and its entropy. HF `generate` runs with its own processors off, so this one alone defines what
    is sampled. The token drawn from step t's scores only appears in `input_ids` at step t+1, so one
    (B, V) log-softmax is kept and gathered one step late."""

    def __init__(self, cfg: RolloutConfig):
        self.cfg = cfg
        self.prev = None  # (B, V) log-probs of the last step's distribution
        self.logps = []  # T × (B,)
        self.entropies = []  # T × (B,)
        self.finite = None  # () bool on the device, every logit so far finite: read in `finish`

    def __call__(self, input_ids, scores):
        finite = torch.isfinite(scores).all(-1, keepdim=True)  # (B, 1), no device→host sync
        self.finite = finite.all() if self.finite is None else self.finite & finite.all()
        scores = torch.where(finite, scores, 0.0)  # a bad row samples uniformly until `finish`
        if self.prev is not None:
            self.logps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        # greedy (T = 0) records the T = 1 log-probs
        z = scores.float() / (self.cfg.temperature or 1.0)  # (B, V)
        # transformers' temperature and top-k warpers give these bits too; its top-p does not (its
        # ascending float32 cumsum kept another set of tokens in 243 of 256 rows of random logits,
        # vocabulary 151,936, top_p 0.95), so all three cuts stay here, as the runs sampled them.
        if 0 < self.cfg.top_k < z.shape[1]:
            z = z.masked_fill(z < z.topk(self.cfg.top_k, dim=-1).values[:, -1:], -torch.inf)
        if self.cfg.top_p < 1:  # drop a token once the more likely ones hold top_p of the mass
            p, order = z.softmax(-1).sort(-1, descending=True)
            drop = (p.cumsum(-1) - p) >= self.cfg.top_p
            z = z.masked_fill(drop.scatter(1, order, drop), -torch.inf)
        self.prev = torch.log_softmax(z, dim=-1)
        self.entropies.append(torch.special.entr(self.prev.exp()).sum(-1))
        return z

    def finish(self, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T) each
        if not bool(self.finite):
            raise FloatingPointError("the policy's logits are not finite (NaN or inf weights)")
        self.logps.append(self.prev.gather(1, last_tokens[:, None]).squeeze(1))
        return torch.stack(self.logps, dim=1), torch.stack(self.entropies, dim=1)


class _CastCache(transformers.DynamicCache):
    """A KV cache that stores K and V in `dtype`. Under autocast the residual stream is float32, so
    RoPE'd keys (and the cache's values after them) would be kept in float32; attention casts them
    to the autocast dtype anyway, so storing them in it changes no number and halves the cache."""

    def __init__(self, dtype: torch.dtype, **kwargs):
        super().__init__(**kwargs)
        self.dtype = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = key_states.to(self.dtype), value_states.to(self.dtype)
        return super().update(keys, values, layer_idx, *args, **kwargs)


def kv_cache(model) -> transformers.DynamicCache | None:
    """The cache to generate with: K and V in the autocast dtype under autocast, else HF's."""
    device = next(model.parameters()).device.type
    if not torch.is_autocast_enabled(device):
        return None
    return _CastCache(torch.get_autocast_dtype(device), config=model.config)


class _StopRequested(transformers.StoppingCriteria):
    """Ends a `generate` call after the token under way once a stop is asked for (preempt.py)."""

    def __call__(self, input_ids, scores, **kwargs):
        B, device = input_ids.shape[0], input_ids.device
        return torch.full((B,), should_stop(), dtype=torch.bool, device=device)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], cfg: RolloutConfig, stop: list[int],
             prompt_idx=None, step: int = 0, counts: list[int] | None = None,
             group0: int | None = None) -> tuple[Rollouts, list[str]]:
    """Sample `counts[i]` (default cfg.group_size) completions of each prompt (token ids),
    cfg.gen_batch_size sequences per HF `generate` call. Returns `pack_groups`' rollouts (reward,
    correctness and advantage left at 0) and texts. A stop (preempt.should_stop) ends it within a
    token: Interrupted."""
    counts = counts or [cfg.group_size] * len(prompts)
    expanded = [p for p, n in zip(prompts, counts) for _ in range(n)]
    was_training = model.training
    hf = lora.hf_model(model)
    own = hf.generation_config  # (under LoRA, the transformers module's inside peft's wrapper)
    model.eval()
    hf.generation_config = GenerationConfig()  # nothing of the model's fills what ours leaves unset
    grpo.output_layer(model)  # float32 logits, as the training pass computes them
    rows = []
    try:
        for start in range(0, len(expanded), cfg.gen_batch_size):
            chunk = expanded[start : start + cfg.gen_batch_size]
            rows += _sample(model, tokenizer, chunk, cfg, stop)
    finally:
        hf.generation_config = own
        model.train(was_training)
    return pack_groups(rows, tokenizer, counts, prompt_idx, step, group0)


def _sample(model, tokenizer, prompts: list[list[int]], cfg: RolloutConfig,
            stop: list[int]) -> list[Row]:
    """One HF `generate` call: a completion of each prompt, left-padded into one batch."""
    if should_stop():
        raise Interrupted
    device = next(model.parameters()).device
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    P = batch["input_ids"].shape[1]
    gen_cfg = GenerationConfig(do_sample=cfg.temperature > 0, temperature=1.0, top_p=1.0, top_k=0,
                               max_new_tokens=cfg.max_new_tokens, eos_token_id=stop or None,
                               pad_token_id=tokenizer.pad_token_id)
    recorder = _SamplingDistribution(cfg)
    out = model.generate(**batch.to(device), generation_config=gen_cfg,
                         logits_processor=LogitsProcessorList([recorder]),
                         past_key_values=kv_cache(model),
                         stopping_criteria=transformers.StoppingCriteriaList([_StopRequested()]))
    if should_stop():  # cut short: the rows are incomplete
        raise Interrupted
    completion = out[:, P:]  # (b, T)
    logp, entropy = recorder.finish(completion[:, -1])  # (b, T) each
    # a completion ends at its first end token; later tokens are padding
    ends = torch.isin(completion, torch.tensor(stop, dtype=torch.long, device=device))  # (b, T)
    lengths = torch.where(ends.any(1), ends.int().argmax(1) + 1, completion.shape[1]).tolist()
    rows = []
    for b, (prompt, n) in enumerate(zip(prompts, lengths)):
        rows.append(Row(ids=prompt + completion[b, :n].tolist(), prompt_len=len(prompt),
                        logp=logp[b, :n].cpu(), truncated=not bool(ends[b].any()),
                        entropy=entropy[b, :n].mean().item()))
    return rows
