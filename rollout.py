"""Rollouts: prompts as token ids, G completions per prompt from Hugging Face `generate`, behaviour log-probs kept.

Shared by train.py and eval.py. A batch of rollouts lives in one small typed container, `Rollouts`: every row is
one sequence laid out as `prompt tokens | completion tokens | right padding`, so the training forward needs no
position-id tricks and the replay buffer can store a row as it is.

What is sampled is defined by our config alone (temperature, top-p, top-k): the model's own generation_config
(repetition penalty, no-repeat n-grams, bad words, min length, its sampling defaults, ...) is set aside for the
call, so the distribution sampled is exactly the one the loss's log-probs describe. The behaviour log-probs are
recorded during generation by the one logits processor that applies temperature/top-p/top-k: no extra pass.

A completion ends at the first end token (kept: the model must learn to stop): the tokenizer's eos, every id in the
model's generation_config.eos_token_id, the chat template's end-of-turn token when the template is applied, and
`rollout.stop_tokens`. It is `truncated` only when none of them appeared within max_new_tokens.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields

import torch
import transformers
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList


@dataclass
class RolloutConfig:
    batch_size: int = 256
    """Fresh rollouts generated per step (= prompts per step × group_size)."""
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are relative within a group."""
    max_new_tokens: int = 48
    """Generation length cap; a completion that reaches it without an end token is truncated and flagged."""
    temperature: float = 1.0
    """Sampling temperature; log-probs in the loss use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; behaviour log-probs are of the truncated distribution actually sampled."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = off); behaviour log-probs are of that distribution."""
    gen_batch_size: int = 256
    """Sequences per HF `generate` call (memory knob for generation; a call may mix several prompts' groups)."""
    stop_tokens: list[str] = field(default_factory=list)
    """Extra end tokens (each one token of the vocabulary), besides eos, generation_config's and the end of turn."""
    mask_truncated: bool = False
    """Leave truncated rows out of the loss (DAPO's overlong filtering); they still count in their group's advantage."""

    def check(self) -> list[tuple[bool, str]]:
        G, n = self.group_size, self.batch_size
        return [(G >= 2, f"rollout.group_size must be ≥ 2 (GRPO compares completions in a group), got {G}"),
                (n > 0 and G > 0 and n % G == 0,
                 f"rollout.batch_size ({n}) must be a positive multiple of rollout.group_size ({G})"),
                (self.max_new_tokens > 0, f"rollout.max_new_tokens must be > 0, got {self.max_new_tokens}"),
                (0 < self.temperature < float("inf"), f"rollout.temperature must be > 0, got {self.temperature}"),
                (0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}"),
                (self.top_k >= 0, f"rollout.top_k must be ≥ 0 (0 = off), got {self.top_k}"),
                (self.gen_batch_size > 0, f"rollout.gen_batch_size must be > 0, got {self.gen_batch_size}")]


@dataclass
class Rollouts:
    """B sequences, each `prompt | completion | pad`, right-padded to length L.

    Token-level tensors are aligned with `tokens`: `behav_logp[b, t]` is log μ(tokens[b, t] | tokens[b, :t]),
    and is 0 outside the completion. Per-rollout fields describe where the row came from and how it scored.
    """

    tokens: torch.Tensor  # (B, L) int64, pad id after seq_len
    prompt_len: torch.Tensor  # (B,) int64, number of prompt tokens (completion starts here)
    seq_len: torch.Tensor  # (B,) int64, prompt + completion tokens (the end token included when emitted)
    behav_logp: torch.Tensor  # (B, L) float32, behaviour-policy log-prob of each completion token
    truncated: torch.Tensor  # (B,) bool, hit max_new_tokens before any end token
    prompt_idx: torch.Tensor  # (B,) int64, index of the prompt in the training set
    group: torch.Tensor  # (B,) int64, rows with the same id share a prompt and form one GRPO group
    born: torch.Tensor  # (B,) int64, training step at which the row was generated
    reward: torch.Tensor  # (B,) float32, scalar reward (rewards.py, plus overlong shaping when on)
    correct: torch.Tensor  # (B,) bool, verified-correct final answer
    advantage: torch.Tensor  # (B,) float32, group-relative advantage (filled by grpo.group_advantages)
    entropy: torch.Tensor  # (B,) float32, mean token entropy of the distribution the row was sampled from
    replayed: torch.Tensor  # (B,) bool, came from the replay buffer rather than this step's generation
    onpolicy: torch.Tensor  # (B,) bool, treat behaviour log-probs as the current policy's (fresh rows, RLEP)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def completion_len(self) -> torch.Tensor:  # (B,)
        return self.seq_len - self.prompt_len

    def completion_mask(self) -> torch.Tensor:  # (B, L) bool
        t = torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :]
        return (t >= self.prompt_len[:, None]) & (t < self.seq_len[:, None])

    def select(self, idx: torch.Tensor) -> Rollouts:
        """Rows `idx` (index tensor or bool mask), trimmed to their longest sequence (no global-max padding)."""
        rows = {f.name: getattr(self, f.name)[idx] for f in fields(self)}
        L = int(rows["seq_len"].max()) if len(rows["seq_len"]) else 1
        rows["tokens"], rows["behav_logp"] = rows["tokens"][:, :L], rows["behav_logp"][:, :L]
        return Rollouts(**rows)

    @staticmethod
    def cat(parts: list[Rollouts], pad_id: int) -> Rollouts:
        """Stack rows of several batches, right-padding token tensors to the longest."""
        L = max(p.tokens.shape[1] for p in parts)
        out = {}
        for f in fields(Rollouts):
            xs = [getattr(p, f.name) for p in parts]
            if f.name in ("tokens", "behav_logp"):
                fill = pad_id if f.name == "tokens" else 0.0
                xs = [torch.nn.functional.pad(x, (0, L - x.shape[1]), value=fill) for x in xs]
            out[f.name] = torch.cat(xs)
        return Rollouts(**out)


def load_model(path: str, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local folder or hub id. Code shipped in the folder runs only with trust_remote_code;
    weights load from safetensors (transformers refuses pickled .bin files unless they load with weights_only)."""
    transformers.utils.logging.disable_progress_bar()  # one line per run, not a bar per file loaded or saved
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, dtype=dtype)
    return model, tokenizer


def load_policy(cfg, path: str, device: torch.device, world: int):
    """The model to train (cfg is config.Config): (model, policy, tokenizer, ref, compute).

    `model` is the HF module with float32 master weights, sharded in place under FSDP; generation, no-grad passes
    and saving use it. `policy` is what the training forward goes through (model, compiled, or DDP-wrapped).
    `compute` is the bf16 autocast context when bf16 compute is on without FSDP (FSDP casts through its
    mixed-precision policy: bf16 parameters for compute, float32 gradient reduction). `ref` is the frozen
    reference for the KL term (beta > 0 only), which may live in bf16 since it is never updated.
    """
    bf16, fsdp = cfg.model.compute_dtype == "bfloat16", cfg.model.parallel == "fsdp" and world > 1
    model, tokenizer = load_model(path, cfg.model.trust_remote_code, torch.float32)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    ref = load_model(cfg.model.path, cfg.model.trust_remote_code, torch.bfloat16 if bf16 else torch.float32)[0] \
        if cfg.grpo.beta > 0 else None
    for m in [model, ref] if ref is not None else [model]:
        if fsdp:  # one FSDP unit per decoder layer (HF lists their classes as never to be split), then the root
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
            for layer in [x for x in m.modules() if type(x).__name__ in (m._no_split_modules or [])]:
                fully_shard(layer, mp_policy=mp)
            fully_shard(m, mp_policy=mp)
        else:
            m.to(device)
    if ref is not None:
        ref.requires_grad_(False).eval()
    policy = torch.compile(model) if cfg.model.compile else model
    if world > 1 and not fsdp:
        policy = torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device.index] if device.index is not None
                                                           else None)
        policy.broadcast_buffers = False  # buffers never change: forwards need no collective
    compute = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 and not fsdp else nullcontext()
    return model, policy, tokenizer, ref, compute


@contextmanager
def full_weights(model, compute):
    """Generation with whole weights: under FSDP they are gathered once (in bf16 with bf16 compute) and stay gathered
    for every token of the phase, then freed, so no collective runs while ranks generate different lengths."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        with compute:
            yield
    finally:
        for m in sharded:
            m.set_reshard_after_forward(True)
            m.reshard()


def prompt_ids(tokenizer, problem: str, template: str, chat: bool, system_prompt: str = "") -> list[int]:
    """Token ids of one prompt: `template` with its {problem} slot filled (plain text, no other placeholders), wrapped
    in the tokenizer's chat template when `chat` and it has one (with `system_prompt` as a system turn when set).
    A chat template writes its own BOS; plain text gets the tokenizer's special tokens (BOS where it adds one)."""
    text = template.replace("{problem}", problem)
    if chat and tokenizer.chat_template:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        turns = system + [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=not (chat and tokenizer.chat_template))["input_ids"]


def build_prompts(tokenizer, problems: list, data, limit: int) -> tuple[list[list[int]], list, int]:
    """(prompt ids, problems kept, number dropped): prompts over `limit` tokens are dropped, as verl does. `data`
    is config.DataConfig; a problem's own system turn is used unless data.system_prompt is set. No tokenizer packs
    32 characters into a token, so longer texts are not even tokenized."""
    ids = [prompt_ids(tokenizer, p.problem, data.template, data.chat_template, data.system_prompt or p.system)
           if len(p.problem) <= 32 * limit else None for p in problems]
    keep = [i for i, x in enumerate(ids) if x is not None and len(x) <= limit]
    return [ids[i] for i in keep], [problems[i] for i in keep], len(problems) - len(keep)


def end_of_turn(tokenizer) -> int | None:
    """The special token a chat template writes right after an assistant turn (<|im_end|>, <|eot_id|>, ...)."""
    try:
        turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "MARK"}]
        after = tokenizer.apply_chat_template(turns, tokenize=False).rsplit("MARK", 1)[1]
    except Exception:  # noqa: BLE001 -- a template that refuses this conversation has no end-of-turn to learn from it
        return None
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    return ids[0] if ids and ids[0] in tokenizer.all_special_ids else None


def end_ids(tokenizer, model, chat: bool, stop_tokens: list[str]) -> list[int]:
    """Every token that ends a completion (see the module docstring). Unknown stop tokens raise ValueError."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    if chat and tokenizer.chat_template:
        ids.add(end_of_turn(tokenizer))
    for s in stop_tokens:
        i = tokenizer.convert_tokens_to_ids(s)
        if not isinstance(i, int) or i == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(i) != s:
            raise ValueError(f"rollout.stop_tokens: {s!r} is not a single token of this tokenizer")
        ids.add(i)
    return sorted(i for i in ids if i is not None)


class _SamplingDistribution(LogitsProcessor):
    """Turns logits into the sampling distribution (÷ temperature, cut to top-k and to the top-p nucleus) and records
    the log-probability of each sampled token under it: the behaviour log-prob, with no extra forward pass.

    HF `generate` runs with its own processors off, so this processor alone defines what is sampled. The token drawn
    from step t's scores only appears in `input_ids` at step t+1, so one (B, V) log-softmax is kept and gathered
    from one step late (O(B·V) memory).
    """

    def __init__(self, cfg: RolloutConfig):
        self.cfg = cfg
        self.prev: torch.Tensor | None = None  # (B, V) log-softmax of the previous step
        self.logps: list[torch.Tensor] = []  # T × (B,)
        self.entropies: list[torch.Tensor] = []  # T × (B,) entropy of the distribution each token was drawn from

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.logps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        if not torch.isfinite(scores).all():
            raise FloatingPointError("the policy's logits are not finite (NaN or inf weights)")
        z = scores.float() / (self.cfg.temperature or 1.0)  # (B, V); greedy (T = 0) records the T = 1 log-probs
        if 0 < self.cfg.top_k < z.shape[1]:
            z = z.masked_fill(z < z.topk(self.cfg.top_k, dim=-1).values[:, -1:], -torch.inf)
        if self.cfg.top_p < 1:  # drop a token once the more likely ones already hold top_p of the mass
            p, order = z.softmax(-1).sort(-1, descending=True)
            drop = (p.cumsum(-1) - p) >= self.cfg.top_p
            z = z.masked_fill(drop.scatter(1, order, drop), -torch.inf)
        self.prev = torch.log_softmax(z, dim=-1)
        self.entropies.append(torch.special.entr(self.prev.exp()).sum(-1))
        return z

    def finish(self, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # -> (B, T), (B, T)
        self.logps.append(self.prev.gather(1, last_tokens[:, None]).squeeze(1))
        return torch.stack(self.logps, dim=1), torch.stack(self.entropies, dim=1)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], cfg: RolloutConfig, stop: list[int],
             prompt_idx: list[int] | None = None, step: int = 0) -> tuple[Rollouts, list[str]]:
    """Sample `cfg.group_size` completions for each prompt (token ids) with HF `generate`, `cfg.gen_batch_size`
    sequences per call. Returns rollouts (B = len(prompts) × G; rows of one prompt adjacent, sharing a group id;
    reward, correctness and advantage left at 0) and the completions' texts before their end token."""
    was_training, own = model.training, model.generation_config
    model.eval()
    device = next(model.parameters()).device
    gen_cfg = GenerationConfig(do_sample=cfg.temperature > 0, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=stop or None,
                               max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    model.generation_config = GenerationConfig()  # nothing of the model's own settings fills what gen_cfg leaves unset
    expanded = [p for p in prompts for _ in range(cfg.group_size)]
    rows, texts, stop_t = [], [], torch.tensor(stop, dtype=torch.long, device=device)
    try:
        for start in range(0, len(expanded), cfg.gen_batch_size):
            chunk = expanded[start : start + cfg.gen_batch_size]
            P = max(map(len, chunk))
            pad = tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (P - len(p)) + p for p in chunk], device=device)  # left-padded
            mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in chunk], device=device)
            recorder = _SamplingDistribution(cfg)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                 logits_processor=LogitsProcessorList([recorder]))
            completion = out[:, P:]  # (b, T)
            logp, entropy = recorder.finish(completion[:, -1])  # (b, T) each
            ends = torch.isin(completion, stop_t)  # a completion ends at its first end token; later tokens are padding
            ended = ends.any(1)
            n = torch.where(ended, ends.int().argmax(1) + 1, completion.shape[1]).tolist()
            for b, p in enumerate(chunk):
                seq, ent = p + completion[b, : n[b]].tolist(), entropy[b, : n[b]].mean().item()
                rows.append((seq, len(p), logp[b, : n[b]].cpu(), not bool(ended[b]), ent))
                texts.append(tokenizer.decode(completion[b, : n[b] - int(ended[b])], skip_special_tokens=True))
    finally:
        model.generation_config = own
        model.train(was_training)
    group = step * len(prompts) + torch.arange(len(prompts))  # unique across steps: replayed rows never collide
    idx = torch.tensor(prompt_idx if prompt_idx is not None else range(len(prompts)))
    G = cfg.group_size
    return pack(rows, tokenizer.pad_token_id, idx.repeat_interleave(G), group.repeat_interleave(G), step), texts


def pack(rows: list, pad_id: int, prompt_idx: torch.Tensor, group: torch.Tensor, step: int) -> Rollouts:
    """rows: (sequence ids, prompt length, completion log-probs, truncated, mean sampling entropy) → one Rollouts."""
    B, L = len(rows), max(len(r[0]) for r in rows)
    tokens, behav = torch.full((B, L), pad_id, dtype=torch.long), torch.zeros(B, L)
    for b, (seq, plen, lp, *_) in enumerate(rows):
        tokens[b, : len(seq)] = torch.as_tensor(seq)
        behav[b, plen : len(seq)] = torch.as_tensor(lp, dtype=torch.float32)
    zeros = torch.zeros(B)
    return Rollouts(tokens=tokens, prompt_len=torch.tensor([r[1] for r in rows]), behav_logp=behav,
                    seq_len=torch.tensor([len(r[0]) for r in rows]), truncated=torch.tensor([bool(r[3]) for r in rows]),
                    prompt_idx=prompt_idx, group=group, born=torch.full((B,), step), reward=zeros.clone(),
                    correct=torch.zeros(B, dtype=torch.bool), advantage=zeros.clone(),
                    entropy=torch.tensor([float(r[4]) for r in rows]),
                    replayed=torch.zeros(B, dtype=torch.bool), onpolicy=torch.ones(B, dtype=torch.bool))

