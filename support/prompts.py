"""Prompts as token ids: the instruction template, the tokenizer's chat template (its failures as
one line naming the setting to change, what it silently leaves out as a warning), prompts over the
context dropped, and the tokens that end a completion.
"""

from __future__ import annotations

import jinja2

from support.util import RunError, oneline


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


MAX_CHARS_PER_TOKEN = 32  # no tokenizer packs more into a token: a longer text is not tokenized


def frame_fault(tokenizer, data, limit: int) -> str | None:
    """Why no prompt can fit in `limit` tokens (None: some may): the prompt without its problem
    (data.template, data.system_prompt, the chat template) is over it. Measured once, from its
    length first, so that a huge template is refused in a moment, not after tokenizing every
    problem inside it."""
    chars = len(data.template) + len(data.system_prompt)
    if chars > MAX_CHARS_PER_TOKEN * limit:
        return f"{chars:,} characters, more than the {limit:,}-token limit can hold"
    ids = prompt_ids(tokenizer, "", data.template, data.chat_template, data.system_prompt)
    if len(ids) > limit:
        return f"{len(ids):,} tokens, over the {limit:,}-token limit"
    return None


def build_prompts(tokenizer, problems: list, data, limit: int,
                  own_system: bool = True) -> tuple[list[list[int]], list, int]:
    """(prompt ids, problems kept, number dropped): prompts over `limit` tokens are dropped, as verl
    does. `data` is config.DataConfig (or has its template, chat_template, system_prompt); a
    problem's own system turn is used (`own_system`) unless data.system_prompt is set."""
    prompts, kept = [], []
    for p in problems:
        if len(p.problem) + len(data.template) > MAX_CHARS_PER_TOKEN * limit:
            continue
        system = data.system_prompt or (p.system if own_system else "")
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


def chat_prompts(cfg, tokenizer, model, path: str, sets: tuple) -> tuple[list, list[str]]:
    """build_prompts of each problem set (cfg is config.Config), those over the context dropped,
    and the notes to print once set-up has succeeded (what was dropped, what the chat template
    leaves out). A chat template that fails, or a template alone over the limit, is one line
    naming the key to change."""
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    limit = cfg.data.max_prompt_tokens or context - cfg.rollout.max_new_tokens
    why = (f"data.max_prompt_tokens, rollout.max_new_tokens and the model's {context} positions "
           "set the limit")
    try:
        fault = frame_fault(tokenizer, cfg.data, limit) if limit > 0 else None
        if fault:
            raise RunError(f"data.template (with data.system_prompt and the chat template) is "
                           f"{fault} before a problem is added ({why})")
        built = [build_prompts(tokenizer, problems, cfg.data, limit) for problems in sets]
        system = cfg.data.system_prompt or next((p.system for p in sets[0] if p.system), "")
        said = template_warnings(tokenizer, system) if cfg.data.chat_template else []
    except ChatTemplateError as e:
        advice = template_advice(e, cfg)
        raise RunError(f"model.path {path}: its chat template {e.said}; {advice}") from e
    notes = [f"warning: model.path {path}: its chat template {what}: the model never sees it"
             for what in said]
    (prompts, _, dropped), (eval_prompts, _, eval_dropped) = built
    if not prompts or not eval_prompts:
        what = "eval" if prompts else "training"
        raise RunError(f"every {what} prompt is over {limit} tokens ({why})")
    if dropped + eval_dropped:
        notes.append(f"note: dropped {dropped} training and {eval_dropped} eval prompts over "
                     f"{limit} tokens")
    return built, notes


def template_advice(e: ChatTemplateError, cfg) -> str:
    """Which setting avoids a chat template's failure."""
    if e.system and cfg.data.system_prompt:
        return "set data.system_prompt= (none) or data.chat_template=false (plain prompts)"
    if e.system:
        return "the data's rows carry a system turn: set data.chat_template=false (plain prompts)"
    return "set data.chat_template=false (plain prompts) or fix the template in the model folder"
