"""Rollouts on folders shaped like real checkpoints (tests/fixtures.py): sampling is defined by our
config alone, every end token stops, prompts follow each family's template, RLEP keeps token ids,
overlong shaping and truncated rows, and each paper config states its prompt."""

import itertools
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

import eval as ev
import train
from config import load_config, validate
from data.loaders import Problem, load_problems
from replay import ReplayConfig, make_replay
from rewards import RewardConfig, overlong_penalty, score_batch
from rollout import HFSampler, RolloutConfig, generate
from analysis import compare
from support.logprobs import token_logprobs
from support.models import load_pretrained
from support.prompts import end_ids, end_of_turn, prompt_ids

sys.path.insert(0, str(Path(__file__).parent))
import fixtures

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = REPO / "data" / "tiny_model"


def teacher_logprobs(model, ro, temperature):
    t = torch.arange(ro.tokens.shape[1])[None]
    lp, _ = token_logprobs(model, ro.tokens, (t < ro.seq_len[:, None]).long(), temperature)
    return lp


def test_the_models_generation_config_never_leaks_into_sampling(tmp_path):
    """A checkpoint whose generation_config sets a repetition penalty, no-repeat n-grams, top-k, bad
    words and a minimum length: the behaviour log-probs recorded while sampling equal the training
    forward's (before the fix, up to 3.8 nats per token apart), and none of those settings shaped
    what was sampled."""
    folder = fixtures.build("qwen25_instruct", tmp_path / "m")
    gen = json.loads((folder / "generation_config.json").read_text())
    banned = 40
    gen |= {"repetition_penalty": 5.0, "no_repeat_ngram_size": 2, "top_k": 3,
            "bad_words_ids": [[banned]], "min_new_tokens": 20, "temperature": 0.3}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    model, tok = load_pretrained(str(folder))
    assert model.generation_config.repetition_penalty == 5.0  # the settings are there to leak
    prompts = [prompt_ids(tok, q, "{problem}", True) for q in ("1+1", "what is 3*4?", "7/8 - 1/8")]
    cfg = RolloutConfig(group_size=8, max_new_tokens=24)
    torch.manual_seed(0)
    ro, _ = generate(model, tok, prompts, cfg, end_ids(tok, model, True, []))
    m = ro.completion_mask()
    gap = (teacher_logprobs(model, ro, 1.0)[m] - ro.behav_logp[m]).abs().max().item()
    print(f"max |behaviour - training log-prob| = {gap:.2e}")
    assert gap <= 1e-4
    comps = [ro.tokens[i, ro.prompt_len[i] : ro.seq_len[i]].tolist() for i in range(len(ro))]
    assert any(banned in c for c in comps) \
        or any(len(set(itertools.pairwise(c))) < len(c) - 1 for c in comps) \
        or any(len(c) < 20 and not ro.truncated[i] for i, c in enumerate(comps)), \
        "sampling ignored every setting"
    # and the model's own config is left as it was
    assert model.generation_config.repetition_penalty == 5.0


@pytest.mark.parametrize("kind", list(fixtures.KINDS))
def test_end_of_turn_stops_generation(tmp_path, kind):
    """A model made to answer `\\boxed{4}` and then emit its family's end-of-turn token: the
    completion stops there, is not truncated, keeps the end token (the model learns to stop) and the
    reward sees the text before it."""
    folder = fixtures.build(kind, tmp_path / kind, emit="\\boxed{4}")
    model, tok = load_pretrained(str(folder))
    stop = end_ids(tok, model, True, [])
    eot = tok.convert_tokens_to_ids(fixtures.KINDS[kind]["end_of_turn"])
    assert end_of_turn(tok) == eot and eot in stop
    if kind == "qwen3_base":
        assert tok.eos_token_id != eot  # the tokenizer alone would never stop here
    ro, texts = generate(model, tok, [prompt_ids(tok, "2+2", "{problem}", True)],
                         RolloutConfig(group_size=4, max_new_tokens=40),
                         stop)
    assert texts == ["\\boxed{4}"] * 4 and not ro.truncated.any()
    assert (ro.tokens[torch.arange(4), ro.seq_len - 1] == eot).all()
    assert (ro.completion_len
            == len(tok("\\boxed{4}", add_special_tokens=False)["input_ids"]) + 1).all()
    assert score_batch(texts, ["4"] * 4, RewardConfig())[1] == [True] * 4


def test_prompts_follow_each_family(tmp_path):
    for kind in fixtures.KINDS:
        _, tok = load_pretrained(str(fixtures.build(kind, tmp_path / kind)))
        chat = tok.decode(prompt_ids(tok, "2+2", "Q: {problem}", True, system_prompt="Be brief."))
        plain = prompt_ids(tok, "2+2", "Q: {problem}", False)
        assert "Be brief." in chat and "Q: 2+2" in chat
        # one BOS: written by the template, or added by the tokenizer to plain text
        if kind == "llama3_instruct":
            assert chat.count("<|begin_of_text|>") == 1 and plain[0] == tok.bos_token_id
        else:
            assert tok.decode(plain) == "Q: 2+2"
    _, tok = load_pretrained(str(fixtures.build("qwen25_instruct", tmp_path / "q")))
    # its default system turn
    assert "You are a helpful assistant." in tok.decode(prompt_ids(tok, "2+2", "{problem}", True))
    # braces are text, not format
    assert "{x}" in tok.decode(prompt_ids(tok, "solve {x}", "{problem} \\boxed{}", True))


def test_stop_tokens_add_more_ends(tmp_path):
    folder = fixtures.build("qwen3_base", tmp_path / "m", emit="\\boxed{4}")
    model, tok = load_pretrained(str(folder))
    stop = end_ids(tok, model, True, ["{"])
    ro, texts = generate(model, tok, [prompt_ids(tok, "2+2", "{problem}", True)],
                         RolloutConfig(group_size=2), stop)
    assert texts == ["\\boxed"] * 2 and not ro.truncated.any()
    with pytest.raises(ValueError, match="is not a single token"):
        end_ids(tok, model, True, ["<|not_a_token|>"])


@pytest.mark.parametrize("kind", list(fixtures.KINDS))
def test_training_and_eval_paths_run_on_each_family(tmp_path, kind):
    folder = fixtures.build(kind, tmp_path / kind, emit="\\boxed{4}")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{4 - i}", "answer": "4"}) + "\n"
                            for i in range(8)))
    out = tmp_path / "run"
    assert train.main(["--config", "configs/tiny.yaml", f"--model.path={folder}",
                       f"--data.train={data}", f"--data.eval={data}", f"--out_dir={out}",
                       "--max_steps=2", "--rollout.batch_size=8", "--rollout.group_size=4",
                       "--eval.n=4", "--eval.k=2", "--wandb.mode=disabled",
                       "--checkpoint.every=0", "--threads=1"]) == 0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert (rows[-1]["eval/accuracy"] == 1.0
            and rows[-1]["truncated_frac"] == 0.0
            and rows[0]["reward_mean"] == 1.0)
    ev.main(["--model", str(out / "final"), "--benchmarks", str(data), "--k", "2", "--limit", "2",
             "--template", "{problem}", "--max-new-tokens", "16"])
    result = json.loads((out / "eval" / "final" / "results.json").read_text())
    assert (result["benchmarks"]["train"]["accuracy"] == 1.0
            and result["benchmarks"]["train"]["truncation_rate"] == 0)


def test_rlep_phase_one_round_trip_keeps_the_sampled_tokens(tmp_path):
    """Phase I (eval.py --save-correct) to phase II (RlepReplay.start): the replayed rows are the
    sampled tokens. Through text (decode, then encode) many rows would come back different."""
    model, tok = load_pretrained(str(MODEL))
    problems = load_problems("tiny_train", limit=96)
    prompts = [prompt_ids(tok, p.problem, "{problem}", True) for p in problems]
    stop = end_ids(tok, model, True, [])
    torch.manual_seed(0)
    records = ev.evaluate(HFSampler(model, tok, stop), prompts, [p.answer for p in problems],
                          RolloutConfig(group_size=8, max_new_tokens=48, gen_batch_size=256),
                          RewardConfig(), keep=True)
    saved = tmp_path / "phase1.jsonl"
    ev.save_correct(str(saved), problems, records, {"generated_tokens": 1234})
    rows = [json.loads(ln) for ln in saved.read_text().splitlines()]
    assert len(rows) >= 128
    cfg = load_config("configs/tiny.yaml",
                      ["--replay.strategy=rlep", f"--replay.rlep_source={saved}"])
    buf = make_replay(cfg.replay, max_len=128, pad_id=tok.pad_token_id, seed=0)
    # phase I's generation, counted in the run's total
    assert buf.start(problems, prompts, tok, cfg) == 1234
    stored = [buf.store.completion(i) for i in range(len(buf))]
    assert stored == [r["completion_ids"] for r in rows][: len(stored)] and len(stored) == len(rows)
    through_text = sum(tok(tok.decode(r["completion_ids"]), add_special_tokens=False)["input_ids"]
                       != r["completion_ids"]
                       for r in rows)
    print(f"{len(rows)} phase-I rows: token-identical after the round trip; "
          f"{through_text} would differ through text")


def test_phase_one_tokens_count_in_the_runs_total(tmp_path):
    """Through train.py: RLEP's phase-I generation (its .meta.json) is in tokens/generated_total
    from step 1 on and in summary.json, beside the fresh generation alone (generated_tokens)."""
    problem = load_problems("tiny_train", limit=1)[0]
    src = tmp_path / "phase1.jsonl"
    src.write_text(json.dumps({"problem": problem.problem,
                               "completion": f"\\boxed{{{problem.answer}}}"}) + "\n")
    (tmp_path / "phase1.jsonl.meta.json").write_text(json.dumps({"generated_tokens": 1234}))
    out = tmp_path / "run"
    assert train.main(["--config", "configs/tiny.yaml", f"--out_dir={out}", "--max_steps=2",
                       "--rollout.batch_size=16", "--rollout.group_size=4", "--eval.n=4",
                       "--eval.k=1", "--wandb.mode=disabled", "--threads=1",
                       "--checkpoint.every=0", "--replay.strategy=rlep",
                       f"--replay.rlep_source={src}"]) == 0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens/generated_total"] - r["generated_tokens"] for r in rows] == [1234, 1234]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_generated_total"] == summary["generated_tokens"] + 1234 > 1234
    assert compare.load_run(out)["curve"][0][1] == 1234  # the initial eval sits after phase I


def test_rlep_text_only_source_still_loads(tmp_path):
    _, tok = load_pretrained(str(MODEL))
    problems = [Problem("1+1", "2", "a"), Problem("2+3", "5", "b")]
    prompts = [prompt_ids(tok, p.problem, "{problem}", True) for p in problems]
    src = tmp_path / "external.jsonl"
    src.write_text(json.dumps({"problem": "2+3", "completion": "\\boxed{5}"}) + "\n")
    buf = make_replay(ReplayConfig(strategy="rlep", rlep_source=str(src)), max_len=64,
                      pad_id=tok.pad_token_id, seed=0)
    cfg = load_config("configs/tiny.yaml", [])
    assert buf.start(problems, prompts, tok, cfg) == 0
    ids = buf.store.completion(0)
    assert ids == tok("\\boxed{5}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert buf.store.prompt_idx.tolist() == [1]


def test_overlong_penalty_hand_values():
    cfg = RewardConfig(overlong_buffer=4, overlong_factor=2.0)
    # max_new_tokens 10: free up to 6, then -2 * (L - 6) / 4
    lengths = torch.tensor([1, 6, 7, 8, 9, 10])
    assert overlong_penalty(lengths, 10, cfg).tolist() == [0.0, 0.0, -0.5, -1.0, -1.5, -2.0]
    assert overlong_penalty(lengths, 10, RewardConfig()).tolist() == [0.0] * 6  # off by default


def test_overlong_shaping_reaches_the_reward(tmp_path):
    """Through train.py: with the buffer as long as max_new_tokens, every reward is its verifier
    score minus factor * length / max_new_tokens, and the advantages come from those shaped
    rewards."""
    out = tmp_path / "run"
    assert train.main(["--config", "configs/tiny.yaml", f"--out_dir={out}", "--max_steps=1",
                       "--rollout.batch_size=16", "--rollout.group_size=4", "--eval.n=4",
                       "--eval.k=1", "--wandb.mode=disabled", "--threads=1",
                       "--reward.overlong_buffer=48", "--reward.overlong_factor=0.5",
                       "--checkpoint.every=0"]) == 0
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward_mean"] == pytest.approx(
        row["correct_mean"] - 0.5 * row["response_len"] / 48, abs=1e-6)


def test_warmup_counts_generation_steps_whatever_the_minibatches(tmp_path):
    lrs = {}
    for mb in (1, 8):
        out = tmp_path / f"mb{mb}"
        assert train.main(["--config", "configs/tiny.yaml", f"--out_dir={out}", "--max_steps=4",
                           "--rollout.batch_size=64", "--optim.warmup_steps=3", "--optim.lr=3e-4",
                           f"--optim.minibatches={mb}", "--eval.n=4", "--eval.k=1",
                           "--wandb.mode=disabled", "--threads=1", "--checkpoint.every=0"]) == 0
        lrs[mb] = [json.loads(ln)["lr"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    # warm-up ends at generation step 3 either way
    assert lrs[1] == lrs[8] == pytest.approx([1e-4, 2e-4, 3e-4, 3e-4])


def test_cosine_schedule():
    cfg = load_config(None, ["--max_steps=10", "--optim.warmup_steps=2", "--optim.schedule=cosine",
                             "--optim.lr=1.0", "--optim.min_lr_ratio=0.1"])
    lrs = [train.get_lr(s, cfg) for s in range(10)]
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])  # warm-up, then the cosine from its peak
    assert lrs[-1] == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 7 / 8)).item()))
    assert all(a >= b for a, b in itertools.pairwise(lrs[1:]))


PAPERS = sorted(p for p in (REPO / "configs" / "papers").glob("*.yaml")
                if p.name != "gpu_base.yaml")


@pytest.mark.parametrize("path", PAPERS, ids=[p.stem for p in PAPERS])
def test_paper_configs_state_their_prompt(path):
    """Every paper config resolves to an explicit prompt (chat template, system turn, instruction),
    and the file that sets it says where the choice comes from."""
    cfg = load_config(str(path), [])
    validate(cfg)
    chain, p = [], path
    while True:
        data = yaml.safe_load(p.read_text())
        chain.append((p, data))
        if "base" not in data:
            break
        p = p.parent / data["base"]
    owner = next((p for p, d in chain
                  if "template" in (d.get("data") or {}) and p.name != "gpu_base.yaml"),
                 None)
    assert owner is not None, f"{path.name} inherits its prompt from gpu_base.yaml alone"
    text = owner.read_text()
    assert {"template", "chat_template", "system_prompt"} <= set(yaml.safe_load(text)["data"])
    assert re.search(r"#.*[Pp]rompt", text), \
        f"{owner.name} does not say where its prompt comes from"
    assert cfg.model.compute_dtype == "bfloat16" and cfg.optim.lr <= 1e-5


def test_eval_entropy_is_the_sampling_policys_token_entropy():
    """eval/entropy (summarize's "entropy"): the mean over every sampled completion token of the
    entropy of the distribution it was drawn from, equal to the one recomputed from the saved
    samples by a plain forward."""
    model, tok = load_pretrained(str(MODEL))
    problems = load_problems("tiny", limit=12)
    prompts = [prompt_ids(tok, p.problem, "{problem}", True) for p in problems]
    torch.manual_seed(0)
    sampler = HFSampler(model, tok, end_ids(tok, model, True, []))
    records = ev.evaluate(sampler, prompts, [p.answer for p in problems],
                          RolloutConfig(group_size=4, max_new_tokens=48), RewardConfig(), keep=True)
    total, n = 0.0, 0
    for p, r in zip(prompts, records):
        for ids in r["ids"]:
            seq = torch.tensor([p + ids])
            _, ent = token_logprobs(model, seq, torch.ones_like(seq), 1.0, with_entropy=True)
            total, n = total + ent[0, len(p):].sum().item(), n + len(ids)
    assert ev.summarize(records)["entropy"] == pytest.approx(total / n, rel=1e-5)
