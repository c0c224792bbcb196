"""Rollouts: sample G completions per prompt with Hugging Face `generate`, keeping behaviour log-probs.

Shared by train.py and eval.py. A batch of rollouts lives in one small typed container, `Rollouts`:
every row is one sequence laid out as `prompt tokens | completion tokens | right padding`, so the
training forward needs no position-id tricks and the replay buffer can store a row as it is.

Behaviour log-probs are the log-probabilities of the *sampling distribution* (after temperature and
top-p), recorded during generation by a logits processor placed after HF's own warpers: no extra forward
pass. They are what the off-policy correction in grpo.py divides by when a rollout is replayed later.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList


@dataclass
class Rollouts:
    """B sequences, each `prompt | completion | pad`, right-padded to length L.

    Token-level tensors are aligned with `tokens`: `behav_logp[b, t]` is log μ(tokens[b, t] | tokens[b, :t]),
    and is 0 outside the completion. Per-rollout fields describe where the row came from and how it scored.
    """

    tokens: torch.Tensor  # (B, L) int64, pad id after seq_len
    prompt_len: torch.Tensor  # (B,) int64, number of prompt tokens (completion starts here)
    seq_len: torch.Tensor  # (B,) int64, prompt + completion tokens (EOS included when emitted)
    behav_logp: torch.Tensor  # (B, L) float32, behaviour-policy log-prob of each completion token
    truncated: torch.Tensor  # (B,) bool, hit max_new_tokens before EOS
    prompt_idx: torch.Tensor  # (B,) int64, index of the prompt in the training set
    group: torch.Tensor  # (B,) int64, rows with the same id share a prompt and form one GRPO group
    born: torch.Tensor  # (B,) int64, training step at which the row was generated
    reward: torch.Tensor  # (B,) float32, scalar reward from rewards.py
    correct: torch.Tensor  # (B,) bool, verified-correct final answer
    advantage: torch.Tensor  # (B,) float32, group-relative advantage (filled by grpo.group_advantages)
    entropy: torch.Tensor  # (B,) float32, mean token entropy of the policy on this row when last trained on
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

    def attention_mask(self) -> torch.Tensor:  # (B, L) int64
        t = torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :]
        return (t < self.seq_len[:, None]).long()

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


def format_prompt(tokenizer, problem: str, template: str) -> str:
    """Fill the instruction template and wrap it in the tokenizer's chat template when it has one."""
    text = template.format(problem=problem)
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


class _SamplingDistribution(LogitsProcessor):
    """Turns logits into the sampling distribution (÷ temperature, cut to the top-p nucleus) and records the
    log-probability of each sampled token under it: the behaviour log-prob, with no extra forward pass.

    HF `generate` runs with its own warpers off (temperature 1, top_p 1, top_k 0), so this processor alone
    defines what is sampled. The token drawn from step t's scores only appears in `input_ids` at step t+1, so
    one (B, V) log-softmax is kept and gathered from one step late (O(B·V) memory).
    """

    def __init__(self, temperature: float, top_p: float):
        self.temperature, self.top_p = temperature, top_p
        self.prev: torch.Tensor | None = None  # (B, V) log-softmax of the previous step
        self.logps: list[torch.Tensor] = []  # T × (B,)

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.logps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        z = scores.float() / (self.temperature or 1.0)  # (B, V); greedy (T = 0) records the T = 1 log-probs
        if self.top_p < 1:  # drop a token once the more likely ones already hold top_p of the mass
            p, order = z.softmax(-1).sort(-1, descending=True)
            drop = (p.cumsum(-1) - p) >= self.top_p
            z = z.masked_fill(drop.scatter(1, order, drop), -torch.inf)
        self.prev = torch.log_softmax(z, dim=-1)
        return z

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:  # -> (B, T)
        self.logps.append(self.prev.gather(1, last_tokens[:, None]).squeeze(1))
        return torch.stack(self.logps, dim=1)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[str],
    group_size: int,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    batch_size: int,
    prompt_idx: list[int] | None = None,
    step: int = 0,
) -> tuple[Rollouts, list[str]]:
    """Sample `group_size` completions for each prompt with HF `generate`. Returns rollouts (B = len(prompts) × G)
    and the texts. Rows of one prompt are adjacent and share a group id; reward, correctness and advantage are
    left at 0 for rewards.py and grpo.py. `batch_size` bounds the sequences of one `generate` call.

    A fresh GenerationConfig is passed so nothing from the model's own generation_config (top_k, repetition
    penalty, ...) changes the distribution: sampling is exactly softmax(logits / T) cut to the top-p nucleus,
    applied by `_SamplingDistribution`.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    gen_cfg = GenerationConfig(do_sample=temperature > 0, temperature=1.0, top_p=1.0, top_k=0,
                               max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id)
    expanded = [p for p in prompts for _ in range(group_size)]
    rows = []
    for start in range(0, len(expanded), batch_size):
        enc = tokenizer(expanded[start : start + batch_size], return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False).to(device)
        recorder = _SamplingDistribution(temperature, top_p)
        out = model.generate(**enc, generation_config=gen_cfg, logits_processor=LogitsProcessorList([recorder]))
        P = enc["input_ids"].shape[1]
        completion = out[:, P:]  # (b, T)
        logp = recorder.finish(completion[:, -1])  # (b, T)
        # A completion ends at its first EOS (kept: the model must learn to stop); later tokens are padding.
        is_eos = completion == eos_id
        has_eos = is_eos.any(1)
        comp_len = torch.where(has_eos, is_eos.int().argmax(1) + 1, completion.shape[1]).tolist()
        prompt_len = enc["attention_mask"].sum(1).tolist()
        for b in range(len(completion)):
            seq = torch.cat([enc["input_ids"][b, P - prompt_len[b] :], completion[b, : comp_len[b]]]).cpu()
            rows.append((seq, prompt_len[b], logp[b, : comp_len[b]].cpu(), not bool(has_eos[b])))
    model.train(was_training)
    texts = tokenizer.batch_decode([seq[plen:] for seq, plen, _, _ in rows], skip_special_tokens=True)
    group = step * len(prompts) + torch.arange(len(prompts))  # unique across steps: replayed rows never collide
    idx = torch.tensor(prompt_idx if prompt_idx is not None else range(len(prompts)))
    return _pack(rows, pad_id, idx.repeat_interleave(group_size), group.repeat_interleave(group_size), step), texts


def _pack(rows: list, pad_id: int, prompt_idx: torch.Tensor, group: torch.Tensor, step: int) -> Rollouts:
    """rows: (sequence ids, prompt length, completion log-probs, truncated) → one right-padded Rollouts."""
    B = len(rows)
    L = max(len(r[0]) for r in rows)
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    behav = torch.zeros(B, L)
    for b, (seq, plen, lp, _) in enumerate(rows):
        tokens[b, : len(seq)] = seq.cpu()
        behav[b, plen : len(seq)] = lp.cpu()
    zeros = torch.zeros(B)
    return Rollouts(
        tokens=tokens,
        prompt_len=torch.tensor([r[1] for r in rows]),
        seq_len=torch.tensor([len(r[0]) for r in rows]),
        behav_logp=behav,
        truncated=torch.tensor([r[3] for r in rows]),
        prompt_idx=prompt_idx,
        group=group,
        born=torch.full((B,), step),
        reward=zeros.clone(),
        correct=torch.zeros(B, dtype=torch.bool),
        advantage=zeros.clone(),
        entropy=zeros.clone(),
        replayed=torch.zeros(B, dtype=torch.bool),
        onpolicy=torch.ones(B, dtype=torch.bool),
    )


def rollouts_from_texts(tokenizer, prompts: list[str], completions: list[str], prompt_idx: list[int], max_new_tokens: int) -> Rollouts:
    """Tokenize given (prompt, completion) pairs into Rollouts, EOS appended, behaviour log-probs 0.

    For rollouts that were not sampled here, e.g. RLEP's phase-I solutions loaded from a JSONL; their
    log-probs must be recomputed (RLEP treats them as on-policy), so `onpolicy` stays True.
    """
    rows = []
    for p, c in zip(prompts, completions):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(c, add_special_tokens=False)["input_ids"][: max_new_tokens - 1] + [tokenizer.eos_token_id]
        rows.append((torch.tensor(p_ids + c_ids), len(p_ids), torch.zeros(len(c_ids)), False))
    return _pack(rows, tokenizer.pad_token_id, torch.tensor(prompt_idx), torch.full((len(rows),), -1), 0)
