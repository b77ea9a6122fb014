"""The training CLI (`eagle_jax.train.__main__.main`, as `python -m eagle_jax.train --recipe ...` runs it) end to end
on a tiny model with SmolLM2's tokenizer."""

import json
from pathlib import Path

import pytest

from builders import run_main
from eagle_jax.gguf_file import gguf_reader, gguf_tokenizer
from eagle_jax.loader import builtin_path

REPO = Path(__file__).resolve().parents[2]

RECIPE = """
[target]
model = "{model}"

[head]
kind = "{kind}"
draft_vocab_size = 512

[data]
dir = "{out}/data"
sources = [{{ kind = "topics", topics = ["otters", "tea"] }}, {{ kind = "jsonl", path = "{jsonl}" }}]
max_new_tokens = 8
batch_size = 4
shard_size = 4
holdout = 0.2
features = "{features}"

[train]
out_dir = "{out}"
steps = 6
batch_size = 2
seq_len = 48
ttt_length = 2
checkpoint_every = 3
log_every = 2
eval_every = 6
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face directory with SmolLM2's real tokenizer."""
    import torch
    import transformers

    d = tmp_path_factory.mktemp("tiny-smol")
    path = builtin_path("smollm2-135m-instruct")
    tok = gguf_tokenizer(gguf_reader(path), str(path))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _run_here(recipe, *extra):
    """The command in this process: each run starts from what the disk holds (data, checkpoints, heads),
    as a fresh `python -m eagle_jax.train` would, and reuses the programs an earlier run compiled. The
    documented commands run as subprocesses in test_docs.py."""
    from eagle_jax.train.__main__ import main

    return run_main(main, "--recipe", recipe, "--json", *extra)


@pytest.mark.slow
@pytest.mark.parametrize("kind,features", [("eagle3", "online"), ("eagle1", "offline")])
def test_recipe_runs_end_to_end_resumes_and_exports_a_loadable_head(tiny_model_dir, tmp_path, kind, features):
    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Describe a lighthouse."}) + "\n")
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(model=tiny_model_dir, kind=kind, out=tmp_path / "run", jsonl=jsonl,
                                    features=features))
    first = _run_here(recipe, "--steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout.strip().splitlines()[-1])["steps"] == 3
    second = _run_here(recipe)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed at step 3" in second.stdout
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6
    prompts = json.loads((tmp_path / "run" / "data" / "prompts.json").read_text())
    assert len(prompts) == 9 and "Describe a lighthouse." in prompts
    import eagle_jax

    target = eagle_jax.load_target(str(tiny_model_dir))
    head = eagle_jax.load_draft(summary["head"], target.cfg)
    assert head.cfg.kind == kind
    r = eagle_jax.generate(target, "hi", draft=head, tree=eagle_jax.TreeConfig(2, 2, 4), max_new_tokens=6)
    assert r.token_ids == eagle_jax.generate(target, "hi", max_new_tokens=6).token_ids
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().strip().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 3, 4, 6]  # the first run (--steps 3) logs its last step
    if kind != "eagle3":
        return
    # A later stage continues from the exported head in the same data directory and appends a source
    # (its prompts are answered and added); the first recipe, rerun, still uses only its own 9.
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"prompt": "Name two rivers."}) + "\n")
    cont = tmp_path / "cont.toml"
    cont.write_text(recipe.read_text().replace('draft_vocab_size = 512', f'draft_vocab_size = 512\ninit_from = "{summary["head"]}"')
                    .replace(f'out_dir = "{tmp_path / "run"}"', f'out_dir = "{tmp_path / "run2"}"')
                    .replace('path = "%s" }]' % jsonl, 'path = "%s" }, { kind = "jsonl", path = "%s" }]' % (jsonl, more)))
    # Time-boxed, with another answer batch size (greedy data does not depend on it): the first step that ends
    # after the limit is the last, exported as a finished run's.
    third = _run_here(cont, "--train-time-limit", "0.001", "--answer-batch-size", "2")
    assert third.returncode == 0, third.stderr[-3000:]
    assert json.loads(third.stdout.strip().splitlines()[-1])["steps"] == 1
    assert "[head] initialised from" in third.stdout
    assert "[data] 10 prompts" in third.stdout and "[data] 8 train / 2 held-out" in third.stdout
    assert json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["done"] == 10
    rerun = _run_here(recipe, "--data-only")  # stops after the data stage
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "[data] 9 prompts" in rerun.stdout and "[data] 8 train / 1 held-out" in rerun.stdout
    assert "[train]" not in rerun.stdout and "[export]" not in rerun.stdout
    again = eagle_jax.load_draft(json.loads(third.stdout.strip().splitlines()[-1])["head"], target.cfg)
    import numpy as np

    np.testing.assert_array_equal(np.asarray(again.d2t[...]), np.asarray(head.d2t[...]))
    bad = tmp_path / "bad.toml"
    bad.write_text(cont.read_text().replace("draft_vocab_size = 512", "draft_vocab_size = 256"))
    out = _run_here(bad)
    assert out.returncode == 2 and "init_from" in out.stderr and "256" in out.stderr
    out = _run_here(recipe, "--train-time-limit", "0")
    assert out.returncode == 2 and "--train-time-limit must be positive" in out.stderr
    out = _run_here(recipe, "--decay-steps", "-1")
    assert out.returncode == 2 and "--decay-steps must be 0 or more" in out.stderr


def test_recipe_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[target]\nmodel='x'\n[head]\n[data]\n[train]\nlearning_rate = 1\n")
    out = _run_here(bad)
    assert out.returncode == 2 and "learning_rate" in out.stderr and "[train]" in out.stderr
    out = _run_here(tmp_path / "missing.toml")
    assert out.returncode == 2 and "missing.toml" in out.stderr
    out = _run_here(REPO / "train" / "smollm2-135m-cpu-demo.toml", "--max-new-tokens", "0", "--out-dir", str(tmp_path / "o"))
    assert out.returncode == 2 and "--max-new-tokens" in out.stderr and "got 0" in out.stderr


def test_recipe_with_an_eval_prompt_is_refused(tiny_model_dir, tmp_path):
    from eagle_jax.train.data import eval_prompts

    mt = next(k for k, v in eval_prompts().items() if v == "MT-bench")
    jsonl = tmp_path / "contaminated.jsonl"
    jsonl.write_text(json.dumps({"prompt": mt}) + "\n")
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(model=tiny_model_dir, kind="eagle3", out=tmp_path / "run", jsonl=jsonl,
                                    features="online"))
    out = _run_here(recipe)
    assert out.returncode == 2 and "MT-bench" in out.stderr and "prompt 0" in out.stderr


def test_shipped_recipes_parse():
    from eagle_jax.train.__main__ import load_recipe
    from eagle_jax.train.trainer import OptimConfig

    recipes = sorted((REPO / "train").glob("*.toml"))
    assert len(recipes) >= 3
    for r in recipes:
        rec = load_recipe(r)
        OptimConfig(**{k: v for k, v in rec["train"].items() if k != "out_dir"})


def test_prompt_sources_are_recorded_and_may_only_be_appended(tmp_path):
    from eagle_jax.train.__main__ import RecipeError, collect_prompts

    one = [{"kind": "topics", "topics": ["otters"]}]
    two = one + [{"kind": "topics", "topics": ["tea"]}]
    first = collect_prompts(None, one, tmp_path / "d", tmp_path, "r.toml")
    assert first and all("otters" in p for p in first)
    recorded = json.loads((tmp_path / "d" / "prompt_sources.json").read_text())
    assert recorded == [{"source": one[0], "prompts": len(first)}]
    # Unchanged sources: the stored prompts are returned as they are.
    (tmp_path / "d" / "prompts.json").write_text(json.dumps(first + ["kept as stored"]))
    assert collect_prompts(None, one, tmp_path / "d", tmp_path, "r.toml")[-1] == "kept as stored"
    both = collect_prompts(None, two, tmp_path / "d", tmp_path, "r.toml")
    assert both[: len(first) + 1] == first + ["kept as stored"] and all("tea" in p for p in both[len(first) + 1:])
    assert json.loads((tmp_path / "d" / "prompts.json").read_text()) == both
    # An earlier stage's recipe (the first recorded sources) gets only their prompts.
    assert collect_prompts(None, one, tmp_path / "d", tmp_path, "r.toml") == first
    with pytest.raises(RecipeError, match="may only be appended"):
        collect_prompts(None, [{"kind": "topics", "topics": ["chess"]}], tmp_path / "d", tmp_path, "r.toml")


def test_jsonl_source_with_whole_conversations(tmp_path):
    from eagle_jax.train.__main__ import RecipeError, collect_prompts
    from eagle_jax.train.data import EvalContaminationError, eval_prompts

    f = tmp_path / "chats.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [{"turns": ["Write a limerick.", "Make it shorter."]},
                                                     {"prompt": "Explain tides."}]) + "\n")
    first = [{"kind": "jsonl", "path": str(f)}]
    assert collect_prompts(None, first, tmp_path / "a", tmp_path, "r.toml") == ["Write a limerick.", "Explain tides."]
    both = first + [{"kind": "jsonl", "path": str(f), "turns": "all"}]
    prompts = collect_prompts(None, both, tmp_path / "a", tmp_path, "r.toml")
    assert prompts[2:] == [["Write a limerick.", "Make it shorter."], "Explain tides."]
    assert json.loads((tmp_path / "a" / "prompts.json").read_text()) == prompts
    assert collect_prompts(None, first, tmp_path / "a", tmp_path, "r.toml") == prompts[:2]
    with pytest.raises(RecipeError, match="turns must be"):
        collect_prompts(None, [{"kind": "jsonl", "path": str(f), "turns": 2}], tmp_path / "b", tmp_path, "r.toml")
    # An evaluation prompt as a follow-up turn is refused, though the first turn alone would pass.
    mt = next(k for k, v in eval_prompts().items() if v == "MT-bench")
    f.write_text(json.dumps({"turns": ["Write a limerick.", mt]}) + "\n")
    assert collect_prompts(None, [{"kind": "jsonl", "path": str(f)}], tmp_path / "c", tmp_path, "r.toml") == [
        "Write a limerick."]
    with pytest.raises(EvalContaminationError, match="turn 2"):
        collect_prompts(None, [{"kind": "jsonl", "path": str(f), "turns": "all"}], tmp_path / "d", tmp_path, "r.toml")


def _campaign_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("accelerator_campaign", REPO / "train" / "accelerator_campaign.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accelerator_campaign_carries_the_model_in_parts_and_refuses_a_wrong_one(tmp_path):
    ac = _campaign_script()
    model = tmp_path / "model.gguf"
    model.write_bytes(bytes(range(256)) * 41 + b"tail")
    folders = ac.pack(tmp_path / "carry", model, parts=3, wheels=False)
    assert [len(list(f.glob("model.*"))) for f in folders] == [1, 1, 1] and (folders[-1] / "index.json").exists()
    work = tmp_path / "device"
    with pytest.raises(ac.CampaignError, match="model.0, model.1 were not stashed"):
        ac.join(folders[-1], work)
    for f in folders[:-1]:
        ac.stash(f, work)
    joined = ac.join(folders[-1], work)
    assert joined.read_bytes() == model.read_bytes() and joined.parent.name == ac.PACKAGE
    (work / "parts" / "model.1").write_bytes(b"x" * (work / "parts" / "model.1").stat().st_size)
    with pytest.raises(ac.CampaignError, match="do not match"):
        ac.join(folders[-1], work)


@pytest.mark.slow
def test_accelerator_campaign_run_answers_trains_and_unpacks(tiny_model_dir, tmp_path):
    """`run` (the device call's job) on the tiny model: a time-boxed answer-and-train run whose shards, manifest
    and head come back as files, and `unpack` adds the shards to a data directory the run continues."""
    ac = _campaign_script()
    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Describe a lighthouse."}) + "\n")
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(model=tiny_model_dir, kind="eagle3", out=tmp_path / "run", jsonl=jsonl,
                                    features="online"))
    carried = tmp_path / "carried"  # no model parts or wheels: the tiny model is a directory here
    carried.mkdir()
    out = tmp_path / "out"
    rc = ac.run(carried, out, recipe, ["--data-time-limit", "600", "--answer-batch-size", "8",
                                       "--train-time-limit", "0.001", "--steps", "4",
                                       "--decay-steps", "0"], work=tmp_path / "work")
    assert rc == 0, (out / "log.txt").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["new_shards"] == 3 and summary["answered"] == 9 and summary["train"]["steps"] == 1
    assert {p.name for p in (out / "head").iterdir()} == {"config.json", "model.safetensors"}
    big = tmp_path / "big.bin"  # a head's weights over a device call's 16 MiB come back in pieces
    big.write_bytes(bytes(range(256)) * 4000)
    ac.copy_in_pieces(big, out / "head", limit=300_000)
    assert sorted(p.name for p in (out / "head").glob("big.bin.piece-*")) == [f"big.bin.piece-{i}" for i in range(4)]
    # Past its budget the job is stopped, and what it had written still comes back with the summary.
    stopped = ac.run(carried, tmp_path / "out2", recipe, ["--steps", "4"], work=tmp_path / "work", budget=0.5)
    assert stopped != 0 and json.loads((tmp_path / "out2" / "summary.json").read_text())["returncode"] == stopped
    assert (tmp_path / "out2" / "data.tar").exists()
    # Unpacked where a recipe's data directory holds nothing yet: every shard and the manifest arrive.
    here = tmp_path / "here.toml"
    here.write_text(recipe.read_text().replace(f'dir = "{tmp_path / "run"}/data"', f'dir = "{tmp_path / "here"}"'))
    (tmp_path / "here").mkdir()
    ac.unpack(out, here, heads=tmp_path / "head-here")
    assert sorted(p.name for p in (tmp_path / "here").glob("shard-*.npz")) == ["shard-00000.npz", "shard-00001.npz",
                                                                               "shard-00002.npz"]
    assert (tmp_path / "head-here" / "model.safetensors").exists()
    assert (tmp_path / "head-here" / "big.bin").read_bytes() == big.read_bytes()
    manifest = json.loads((tmp_path / "here" / "manifest.json").read_text())
    manifest["shards"][0] = "shard-other.npz"  # a directory the run's data does not continue
    (tmp_path / "here" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ac.CampaignError, match="does not continue"):
        ac.unpack(out, here, heads=tmp_path / "head-here")
