"""Rollouts: sample G completions per prompt with a KV-cached decoding loop, keeping behaviour log-probs.

Shared by train.py and eval.py. A batch of rollouts lives in one small typed container, `Rollouts`:
every row is one sequence laid out as `prompt tokens | completion tokens | right padding`, so the
training forward needs no position-id tricks and the replay buffer can store a row as it is.

Behaviour log-probs are the log-probabilities of the *sampling distribution* (after temperature and
top-p), recorded as each token is drawn: no extra forward pass. They are what the off-policy correction
in grpo.py divides by when a rollout is replayed later. The loop does what `model.generate` would with
do_sample, temperature and top_p (and nothing from the model's generation_config, so the distribution is
exactly the one the loss assumes), but runs each prompt once for its G samples and drops finished rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from transformers import DynamicCache


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
    """Sample `group_size` completions for each prompt. Returns rollouts (B = len(prompts) × G) and the texts.

    Rows of one prompt are adjacent and share a group id. Reward, correctness and advantage are left at 0
    for rewards.py and grpo.py to fill. `batch_size` bounds how many sequences are decoded together.
    """
    was_training = model.training
    model.eval()
    per_call = max(1, batch_size // group_size)  # prompts per call: their G copies make up one decoding batch
    rows = []
    for start in range(0, len(prompts), per_call):
        rows += _sample(model, tokenizer, prompts[start : start + per_call], group_size, max_new_tokens, temperature, top_p)
    model.train(was_training)
    texts = tokenizer.batch_decode([seq[plen:] for seq, plen, _, _ in rows], skip_special_tokens=True)
    group = step * len(prompts) + torch.arange(len(prompts))  # unique across steps: replayed rows never collide
    idx = torch.tensor(prompt_idx if prompt_idx is not None else range(len(prompts)))
    return _pack(rows, tokenizer.pad_token_id, idx.repeat_interleave(group_size), group.repeat_interleave(group_size), step), texts


def _sample(model, tokenizer, prompts: list[str], G: int, max_new_tokens: int, temperature: float, top_p: float) -> list:
    """Decode G completions of each prompt with a KV cache. Returns rows (ids, prompt length, completion log-probs, truncated).

    Two savings over `model.generate` on G copies of each prompt, neither of which changes what is sampled:
    each prompt is run through the model once and its KV cache copied G times, and rows that have emitted EOS
    leave the batch (once they are a quarter of it: dropping them copies the cache) instead of decoding padding.
    """
    device = next(model.parameters()).device
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False).to(device)
    ids, attn = enc["input_ids"], enc["attention_mask"]  # (n, P), left-padded
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0),
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # (n, V)
    copy = torch.arange(len(prompts), device=device).repeat_interleave(G)  # (B,) prompt of each row
    cache.batch_select_indices(copy)
    logits, attn = logits[copy], attn[copy]
    B = len(copy)
    out = torch.full((B, max_new_tokens), pad_id, device=device)  # (B, T) completion tokens
    logp = torch.zeros(B, max_new_tokens, device=device)  # (B, T) behaviour log-probs
    has_eos = torch.zeros(B, dtype=torch.bool, device=device)
    row = torch.arange(B, device=device)  # (b,) output row of each sequence still in the batch
    pos = attn.sum(1)  # (b,) position id of the next token
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (b,) emitted EOS, not yet dropped
    for t in range(max_new_tokens):
        token, token_logp = _draw(logits, temperature, top_p)  # (b,), (b,)
        token = torch.where(done, pad_id, token)
        out[row, t], logp[row, t] = token, torch.where(done, 0.0, token_logp)
        ended = ~done & (token == eos_id)
        has_eos[row[ended]] = True
        done = done | ended
        if t + 1 == max_new_tokens or bool(done.all()):
            break
        if int(done.sum()) * 4 >= len(done):
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            row, token, attn, pos, done = row[keep], token[keep], attn[keep], pos[keep], done[keep]
        attn = torch.cat([attn, attn.new_ones(len(attn), 1)], 1)
        logits = model(input_ids=token[:, None], attention_mask=attn, position_ids=pos[:, None],
                       past_key_values=cache, use_cache=True).logits[:, -1]  # (b, V)
        pos = pos + 1
    # A completion ends at its first EOS (kept: the model must learn to stop).
    comp_len = torch.where(has_eos, (out == eos_id).int().argmax(1) + 1, max_new_tokens).tolist()
    prompt_len = enc["attention_mask"].sum(1).tolist()
    P = ids.shape[1]
    return [
        (torch.cat([ids[i // G, P - prompt_len[i // G] :], out[i, : comp_len[i]]]).cpu(), prompt_len[i // G],
         logp[i, : comp_len[i]].cpu(), not bool(has_eos[i]))
        for i in range(B)
    ]


def _draw(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T) cut to the top-p nucleus (greedy when T = 0), and its log-prob
    under exactly that distribution: the behaviour log-prob that grpo.py divides by when the row is replayed."""
    z = logits.float()  # (b, V)
    if temperature > 0:
        z = z / temperature
        if top_p < 1:  # drop a token once the more likely ones already hold top_p of the mass (as HF's TopPLogitsWarper)
            p, order = z.softmax(-1).sort(-1, descending=True)
            drop = (p.cumsum(-1) - p) >= top_p
            z = z.masked_fill(drop.scatter(1, order, drop), -torch.inf)
        token = torch.multinomial(z.softmax(-1), 1).squeeze(1)
    else:
        token = z.argmax(-1)
    return token, z.log_softmax(-1).gather(1, token[:, None]).squeeze(1)


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
