"""Training-data generation: eval-set exclusion, prompt sources, shards, resume."""

import dataclasses
import json

import numpy as np
import pytest

import eagle_jax
from eagle_jax.config import ModelConfig
from eagle_jax.gguf_file import gguf_reader, gguf_tokenizer
from eagle_jax.loader import Target, builtin_path
from eagle_jax.model import random_model
from eagle_jax.train import data


@pytest.fixture(scope="module")
def tiny_with_real_tokenizer():
    """A tiny random model that speaks SmolLM2's tokenizer and chat template (fast, real text plumbing)."""
    path = builtin_path("smollm2-135m-instruct")
    tok = gguf_tokenizer(gguf_reader(path), str(path))
    cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_embeddings=True, max_position=1024,
                      eos_token_ids=(2,))
    return Target(model=random_model(cfg, seed=1), tokenizer=tok, name="tiny-smollm-tok", source="random")


def test_mt_bench_and_humaneval_prompts_are_refused():
    banned = data.eval_prompts()
    assert sum(1 for v in banned.values() if v == "MT-bench") >= 150  # 80 questions x 2 turns
    assert sum(1 for v in banned.values() if v == "HumanEval") == 164
    mt = next(k for k, v in banned.items() if v == "MT-bench")
    he = next(k for k, v in banned.items() if v == "HumanEval")
    data.check_not_eval(["Tell me about otters.", "Write a haiku."])  # fine
    with pytest.raises(data.EvalContaminationError, match="prompt 1 is a MT-bench"):
        data.check_not_eval(["ok", "  " + mt.upper().replace(" ", "   ") + "\n"])
    with pytest.raises(data.EvalContaminationError, match="HumanEval"):
        data.check_not_eval([he])


def test_generate_dataset_refuses_contaminated_prompts(tiny_with_real_tokenizer, tmp_path):
    mt = next(k for k, v in data.eval_prompts().items() if v == "MT-bench")
    with pytest.raises(data.EvalContaminationError):
        data.generate_dataset(tiny_with_real_tokenizer, ["hello there", mt], tmp_path / "d")
    assert not (tmp_path / "d" / "manifest.json").exists()


def test_jsonl_prompt_formats(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "A"}, {"turns": ["B", "B2"]},
            {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "C"},
                               {"from": "gpt", "value": "x"}]}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert data.load_jsonl_prompts(f) == ["A", "B", "C"]
    # Whole conversations on request: several user turns become a list, a single one stays a string.
    rows.append({"conversations": [{"from": "human", "value": "D"}, {"from": "gpt", "value": "y"},
                                   {"from": "human", "value": "D2"}]})
    rows.append({"turns": ["E"]})
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert data.load_jsonl_prompts(f) == ["A", "B", "C", "D", "E"]
    assert data.load_jsonl_prompts(f, turns="all") == ["A", ["B", "B2"], "C", ["D", "D2"], "E"]
    with pytest.raises(ValueError, match="turns must be"):
        data.load_jsonl_prompts(f, turns="second")
    f.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:1: expected a 'prompt'"):
        data.load_jsonl_prompts(f)


def test_shards_hold_prompt_plus_target_answer_and_resume_exactly(tiny_with_real_tokenizer, tmp_path):
    tgt = tiny_with_real_tokenizer
    prompts = data.topic_prompts(["rivers", "bread", "chess"])[:10]
    settings = data.GenerationSettings(max_new_tokens=6, temperature=0.9, batch_size=3, shard_size=4, seed=5)
    full = data.generate_dataset(tgt, prompts, tmp_path / "full", settings)
    assert full["done"] == 10 and len(full["shards"]) == 3
    # Stopped at limit=5 (the last shard short), then extended to all prompts: identical content.
    part = data.generate_dataset(tgt, prompts, tmp_path / "resumed", settings, limit=5)
    assert part["done"] == 5 and len(part["shards"]) == 2  # a short last shard
    data.generate_dataset(tgt, prompts, tmp_path / "resumed", settings)
    a, b = data.read_dataset(tmp_path / "full"), data.read_dataset(tmp_path / "resumed")
    assert len(a) == len(b) == 10
    for (ta, ma), (tb, mb) in zip(a, b):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(ma, mb)
    # Each row: the chat-formatted prompt (mask 0), then the target's sampled answer (mask 1).
    for i, (tok, mask) in enumerate(a):
        ids = data._conversation_ids(tgt.tokenizer, prompts[i])
        np.testing.assert_array_equal(tok[: len(ids)], ids)
        assert mask[: len(ids)].sum() == 0 and mask[len(ids):].all() and 1 <= mask.sum() <= 6
        answer = eagle_jax.generate(tgt, [prompts[i]], max_new_tokens=6, temperature=0.9, seed=5 + i)
        np.testing.assert_array_equal(tok[len(ids):], answer.token_ids[0])
    with pytest.raises(ValueError, match="other generation settings"):
        data.generate_dataset(tgt, prompts, tmp_path / "full", data.GenerationSettings(max_new_tokens=7))
    # More prompts appended later (a second training stage): the data grows, answered rows stay.
    data.generate_dataset(tgt, prompts[:7], tmp_path / "grown", settings)
    grown = data.generate_dataset(tgt, prompts, tmp_path / "grown", settings)
    assert grown["done"] == 10 and grown["prompts"] == 10
    for (ta, _), (tb, _) in zip(a, data.read_dataset(tmp_path / "grown")):
        np.testing.assert_array_equal(ta, tb)
    changed = list(prompts)
    changed[2] = "Something else entirely."
    with pytest.raises(ValueError, match="may only be appended"):
        data.generate_dataset(tgt, changed, tmp_path / "grown", settings)


def test_greedy_data_continues_with_another_batch_size_and_stops_at_its_deadline(tiny_with_real_tokenizer, tmp_path):
    """A greedy directory may be continued with a larger batch (an accelerator's), with the answers a single
    run gives; a deadline already past starts no shard, and the next run goes on where it stopped."""
    import time

    tgt = tiny_with_real_tokenizer
    prompts = data.topic_prompts(["rivers", "bread", "chess"])[:8]
    small = data.GenerationSettings(max_new_tokens=6, batch_size=2, shard_size=4)
    whole = data.generate_dataset(tgt, prompts, tmp_path / "whole", small)
    assert whole["done"] == 8
    assert data.generate_dataset(tgt, prompts, tmp_path / "mixed", small, limit=4)["done"] == 4
    stopped = data.generate_dataset(tgt, prompts, tmp_path / "mixed", small, deadline=time.monotonic())
    assert stopped["done"] == 4 and len(stopped["shards"]) == 1
    data.generate_dataset(tgt, prompts, tmp_path / "mixed", dataclasses.replace(small, batch_size=4))
    for (ta, ma), (tb, mb) in zip(data.read_dataset(tmp_path / "whole"), data.read_dataset(tmp_path / "mixed"),
                                  strict=True):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(ma, mb)
    sampled = dataclasses.replace(small, temperature=0.9)
    data.generate_dataset(tgt, prompts, tmp_path / "sampled", sampled, limit=4)
    with pytest.raises(ValueError, match="other generation settings"):  # sampled rows are seeded by batch
        data.generate_dataset(tgt, prompts, tmp_path / "sampled", dataclasses.replace(sampled, batch_size=4))


def test_continuous_batching_writes_the_shards_static_batches_write(tiny_with_real_tokenizer, tmp_path, monkeypatch):
    """Every turn a request of the server's loop (rows refilled as answers end, later turns queued as soon
    as the earlier answer ends): the same conversations, token for token, greedy and sampled; a directory
    started with static batches goes on continuously; a deadline already past starts no shard; a turn
    longer than a row holds is answered alone."""
    import time

    from eagle_jax.train import answering

    tgt = tiny_with_real_tokenizer
    prompts = [["Tell me about rivers.", "Shorter, please."], "Bake bread.", ["Chess?", "Why?", "Example?"],
               "Tea.", ["Name a tree.", "Another one."], "Owls.", ["Rain.", "Snow?"], "Moss."]
    for temperature in (0.0, 0.9):
        settings = data.GenerationSettings(max_new_tokens=6, temperature=temperature, batch_size=3, shard_size=3,
                                           seed=5)
        static, cont = tmp_path / f"static{temperature}", tmp_path / f"cont{temperature}"
        data.generate_dataset(tgt, prompts, static, settings)
        if temperature == 0.0:  # started with static batches, stopped by a deadline, continued continuously
            assert data.generate_dataset(tgt, prompts, cont, settings, limit=3)["done"] == 3
            stopped = data.generate_dataset(tgt, prompts, cont, settings, deadline=time.monotonic(), continuous=True)
            assert stopped["done"] == 3 and len(stopped["shards"]) == 1
            monkeypatch.setattr(answering, "MAX_MODEL_LEN", 48)  # first turns fit (~34 + 6 tokens), later ones not
        alone = []
        generate = eagle_jax.generate
        monkeypatch.setattr(eagle_jax, "generate", lambda *a, **k: alone.append(1) or generate(*a, **k))
        grown = data.generate_dataset(tgt, prompts, cont, settings, continuous=True)
        assert grown["done"] == 8 and len(grown["shards"]) == 3
        assert len(alone) == (2 if temperature == 0.0 else 0)  # greedy: the second turns of prompts 4 and 6
        a, b = data.read_dataset(static), data.read_dataset(cont)
        assert len(a) == len(b) == 8
        for (ta, ma), (tb, mb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(ma, mb)
        monkeypatch.undo()


@pytest.mark.slow
def test_multi_turn_conversations_hold_every_answer_under_the_loss_mask(tiny_with_real_tokenizer, tmp_path):
    tgt = tiny_with_real_tokenizer
    tok = tgt.tokenizer
    prompts = ["Name a river.", ["Write a haiku about tea.", "Make it shorter."], "Explain chess openings.",
               ["What is bread?", "Now explain it to a child.", "Give an example in Python."],
               ["Say hi.", "Say bye."], "One more single turn."]
    for temperature in (0.0, 0.9):
        settings = data.GenerationSettings(max_new_tokens=5, temperature=temperature, batch_size=2, shard_size=4,
                                           seed=3)
        out = tmp_path / f"t{temperature}"
        data.generate_dataset(tgt, prompts, out, settings)
        rows = data.read_dataset(out)
        assert len(rows) == len(prompts)
        for i, (p, (ids, mask)) in enumerate(zip(prompts, rows)):
            turns = data.prompt_turns(p)
            # The answers are exactly the masked runs, one per turn, in order.
            edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
            spans = list(zip(edges[::2], edges[1::2]))
            assert len(spans) == len(turns) and mask[0] == 0
            messages = []
            for k, (a, b) in enumerate(spans):
                # Before answer k: the chat template of the conversation so far (earlier answers included).
                messages.append({"role": "user", "content": turns[k]})
                want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                assert tok.decode(ids[:a].tolist(), skip_special_tokens=False) == want
                # The answer is what the target writes in that context with turn k's seed.
                seed = settings.seed + i + k * data.TURN_SEED_STRIDE
                again = eagle_jax.generate(tgt, [ids[:a].tolist()], max_new_tokens=5, temperature=temperature,
                                           seed=seed, chat=False)
                np.testing.assert_array_equal(ids[a:b], again.token_ids[0])
                answer = tok.decode(ids[a:b].tolist(), skip_special_tokens=True)
                messages.append({"role": "assistant", "content": answer})
            assert spans[-1][1] == len(ids)  # the conversation ends with the last answer
        if temperature == 0.0:
            # Single-turn rows are what they are in single-turn data (the same prompt ids and answer).
            alone = data.generate_dataset(tgt, [p for p in prompts if isinstance(p, str)], tmp_path / "single",
                                          settings)
            assert alone["done"] == 3
            single = data.read_dataset(tmp_path / "single")
            for (ta, ma), (tb, mb) in zip(single, [rows[0], rows[2], rows[5]]):
                np.testing.assert_array_equal(ta, tb)
                np.testing.assert_array_equal(ma, mb)


def test_followup_turn_closes_an_unfinished_answer_and_reuses_an_eos(tiny_with_real_tokenizer):
    tok = tiny_with_real_tokenizer.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok("Hello there", add_special_tokens=False)["input_ids"]
    truncated = data._followup_ids(tok, ["Hi", "Again"], [ids], eos_ids=(end,))
    finished = data._followup_ids(tok, ["Hi", "Again"], [ids + [end]], eos_ids=(end,))
    assert tok.decode(truncated) == "<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
    assert truncated == [end] + finished


@pytest.mark.slow  # heavy on a cold cache: CI runs it, the quick loop does not
def test_multi_turn_data_resumes_exactly(tiny_with_real_tokenizer, tmp_path):
    tgt = tiny_with_real_tokenizer
    prompts = [["Tell me about rivers.", "Shorter, please."], "Bake bread.", ["Chess?", "Why?", "Example?"],
               "Tea.", ["Name a tree.", "Another one."], "Owls.", ["Rain.", "Snow?"]]
    for temperature in (0.0, 0.9):
        settings = data.GenerationSettings(max_new_tokens=4, temperature=temperature, batch_size=2, shard_size=3,
                                           seed=11)
        full = tmp_path / f"full{temperature}"
        resumed = tmp_path / f"resumed{temperature}"
        data.generate_dataset(tgt, prompts, full, settings)
        assert data.generate_dataset(tgt, prompts, resumed, settings, limit=4)["done"] == 4
        data.generate_dataset(tgt, prompts, resumed, settings)
        a, b = data.read_dataset(full), data.read_dataset(resumed)
        assert len(a) == len(b) == 7
        for (ta, ma), (tb, mb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(ma, mb)
    # The prompts' hash covers the turns: a changed follow-up is a changed prompt.
    changed = list(prompts)
    changed[0] = ["Tell me about rivers.", "Longer, please."]
    with pytest.raises(ValueError, match="may only be appended"):
        data.generate_dataset(tgt, changed, full, settings)


def test_eval_prompts_are_refused_in_any_turn(tiny_with_real_tokenizer, tmp_path):
    mt = next(k for k, v in data.eval_prompts().items() if v == "MT-bench")
    he = next(k for k, v in data.eval_prompts().items() if v == "HumanEval")
    data.check_not_eval(["fine", ["also fine", "still fine"]])
    with pytest.raises(data.EvalContaminationError, match=r"prompt 1 \(turn 2\) is a MT-bench"):
        data.check_not_eval(["fine", ["also fine", mt.upper()]])
    with pytest.raises(data.EvalContaminationError, match=r"prompt 0 \(turn 3\) is a HumanEval"):
        data.check_not_eval([["a", "b", he]])
    with pytest.raises(data.EvalContaminationError):
        data.generate_dataset(tiny_with_real_tokenizer, ["hello", ["hi", mt]], tmp_path / "d")
    assert not (tmp_path / "d" / "manifest.json").exists()
    with pytest.raises(ValueError, match="prompt 1: a prompt is a string or a non-empty list"):
        data.generate_dataset(tiny_with_real_tokenizer, ["hello", []], tmp_path / "d")


@pytest.mark.slow
def test_committed_answers_are_reproduced_through_the_public_api(tmp_path, smollm2):
    """Answers of the shipped head's data, regenerated by today's pipeline, are what is committed: the eight
    shortest of the first batch, in one batch (greedy decoding does not depend on the batch a prompt is in,
    and eight short answers cost a fraction of the 32 x 256-token batch)."""
    from pathlib import Path

    d = Path(__file__).resolve().parents[2] / "train" / "data" / "smollm2-135m-instruct-eagle3"
    manifest = json.loads((d / "manifest.json").read_text())
    settings = data.GenerationSettings(**manifest["settings"])
    prompts = json.loads((d / "prompts.json").read_text())
    committed = data.read_dataset(d)[:settings.batch_size]
    pick = sorted(range(len(committed)), key=lambda i: (len(committed[i][0]), i))[:8]
    data.generate_dataset(smollm2, [prompts[i] for i in pick], tmp_path / "again",
                          dataclasses.replace(settings, batch_size=8))
    again = data.read_dataset(tmp_path / "again")
    assert len(again) == 8
    for i, (tb, mb) in zip(pick, again, strict=True):
        ta, ma = committed[i]
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(ma, mb)


def test_user_turn_prefix_ends_where_the_user_text_starts(tiny_with_real_tokenizer):
    tok = tiny_with_real_tokenizer.tokenizer
    prefix = tok.decode(data.user_turn_prefix(tok))
    assert prefix.endswith("<|im_start|>user\n")


@pytest.mark.slow
def test_magpie_prompts_from_the_real_target_are_user_messages(smollm2, monkeypatch):
    import eagle_jax.engine

    tgt = smollm2
    real, rows = eagle_jax.engine.generate, []

    def counted(target, prompts, **k):
        rows.append(len(prompts))
        return real(target, prompts, **k)

    monkeypatch.setattr(eagle_jax.engine, "generate", counted)
    prompts = data.magpie_prompts(tgt, 3, seed=0, max_tokens=48)
    assert rows and set(rows) == {8}  # full batches even for 3 prompts: one compiled shape per run
    assert len(prompts) == 3
    assert all(len(p) >= 8 and "<|im" not in p for p in prompts)
    assert len(set(prompts)) == 3


@pytest.mark.slow
def test_magpie_prompts_resume_from_their_checkpoint(tmp_path, monkeypatch, smollm2):
    import eagle_jax.engine

    tgt = smollm2
    real, calls = eagle_jax.engine.generate, []

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(eagle_jax.engine, "generate", counted)
    whole = data.magpie_prompts(tgt, 4, seed=7, max_tokens=48, batch_size=2)
    batches, calls[:] = len(calls), []
    assert batches >= 2
    ckpt = tmp_path / "magpie.json"

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt  # the session ends during the second batch
        return real(*a, **k)

    monkeypatch.setattr(eagle_jax.engine, "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        data.magpie_prompts(tgt, 4, seed=7, max_tokens=48, batch_size=2, checkpoint=ckpt)
    assert json.loads(ckpt.read_text())["attempt"] == 2
    monkeypatch.setattr(eagle_jax.engine, "generate", counted)
    calls[:] = []
    assert data.magpie_prompts(tgt, 4, seed=7, max_tokens=48, batch_size=2, checkpoint=ckpt) == whole
    assert len(calls) == batches - 1  # the first batch came from the checkpoint
    assert not ckpt.exists()


def test_online_and_offline_features_give_identical_batches(tiny_with_real_tokenizer, tmp_path):
    from eagle_jax.train import features as F

    tgt = tiny_with_real_tokenizer
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 49152, size=n).astype(np.int32), (np.arange(n) > n // 2).astype(np.uint8))
            for n in (5, 17, 9, 30, 12)]
    ex = F.FeatureExtractor(tgt, aux_layers=(0, 1, 1))
    F.write_offline(ex, rows, batch_size=2, seq_len=16, out_dir=tmp_path / "feats")
    online = [ex(b) for _, b in F.token_batches(rows, 2, 16)]
    offline = list(F.read_offline(tmp_path / "feats"))
    assert len(online) == len(offline) == 3
    for a, b in zip(online, offline):
        for name in ("tokens", "loss_mask", "valid", "hidden", "aux"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert online[0].aux.shape == (2, 16, 3 * 32) and online[0].hidden.shape == (2, 16, 32)
    # Rows are cut at seq_len, padded rows are invalid, and the data position resumes mid-epoch.
    assert online[1].valid[1].all() and not online[2].valid[1].any()
    nxt, first = next(F.token_batches(rows, 2, 16, start=2))
    assert nxt == 4
    np.testing.assert_array_equal(first.tokens, online[1].tokens)
    # Computed on first use: a run that starts mid-epoch writes only what it reads; later passes read the
    # files back without calling the target, and give the same batches.
    calls = []
    counting = lambda b: calls.append(1) or ex(b)
    lazy = list(F.cached_feature_batches(counting, rows, 2, 16, tmp_path / "lazy", start_batch=1))
    assert len(calls) == 2 and sorted(p.name for p in (tmp_path / "lazy").glob("batch-*")) == [
        "batch-000001.npz", "batch-000002.npz"]
    again = list(F.cached_feature_batches(counting, rows, 2, 16, tmp_path / "lazy"))
    assert len(calls) == 3 and len(again) == 3
    for a, b in zip(online, again):
        for name in ("tokens", "loss_mask", "valid", "hidden", "aux"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(lazy[0].hidden, online[1].hidden)
    with pytest.raises(ValueError, match="use a new features_dir"):
        next(F.cached_feature_batches(counting, rows, 4, 16, tmp_path / "lazy"))


def test_draft_vocab_keeps_the_most_frequent_answer_tokens():
    from eagle_jax.train.features import build_draft_vocab

    rows = [(np.array([5, 5, 5, 9, 9, 1, 7]), np.array([0, 1, 1, 1, 1, 1, 1])),
            (np.array([7, 7, 3]), np.array([1, 1, 0]))]
    # answer-token counts: 5:2, 9:2, 7:3, 1:1 (3 and the first 5 are prompt tokens)
    d2t, t2d = build_draft_vocab(rows, vocab_size=12, draft_vocab_size=4, always=(11,))
    kept = np.arange(4) + d2t
    np.testing.assert_array_equal(kept, [5, 7, 9, 11])
    assert t2d.sum() == 4 and t2d[[5, 7, 9, 11]].all() and (d2t >= 0).all()


@pytest.mark.slow  # the real target answering twice
def test_answering_benchmark_compares_static_and_continuous_batches(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "answering.json"
    proc = subprocess.run([sys.executable, "benchmarks/data_answering.py", "--start", "0", "--count", "3",
                           "--warmup", "1", "--max-new-tokens", "5", "--batch-size", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["conversations"] == 3 and result["turns"] >= 3
    tokens = [result["results"][mode]["answer_tokens"] for mode in ("static", "continuous")]
    assert tokens[0] == tokens[1] and result["turns"] <= tokens[0] <= 5 * result["turns"]
    assert result["identical_conversations"] == 3  # the same greedy answers both ways
    assert "continuous / static" in proc.stdout
