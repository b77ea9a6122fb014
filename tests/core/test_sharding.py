"""Tensor and data parallelism (`eagle_jax.sharding`): the layout rules, the errors, and greedy output on a
mesh of fake CPU devices equal to one device's, plain and speculative.

Multi-device checks run in a subprocess: JAX fixes its CPU device count when it starts, and this process
has one device."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builders import TINY, run_on_fake_devices, tiny_target
from eagle_jax.config import ConfigError
from eagle_jax.sharding import check_fits, make_mesh, mesh_shape, param_spec

ROOT = Path(__file__).resolve().parents[2]


def test_param_specs_follow_the_layout_rules():
    from jax.sharding import PartitionSpec as P

    cfg = dataclasses.replace(TINY, num_heads=8, num_kv_heads=8, vocab_size=96)
    assert param_spec(("layers", "0", "wq"), (48, 48), cfg, 4) == P(None, "model")
    assert param_spec(("layers", "0", "wk"), (48, 48), cfg, 4) == P(None, "model")
    assert param_spec(("layers", "0", "wo"), (48, 48), cfg, 4) == P("model", None)
    assert param_spec(("layers", "0", "w_down"), (96, 48), cfg, 4) == P("model", None)
    assert param_spec(("layers", "0", "w_up"), (48, 96), cfg, 4) == P(None, "model")
    assert param_spec(("embed",), (96, 48), cfg, 4) == P("model", None)
    assert param_spec(("layers", "0", "attn_norm"), (48,), cfg, 4) == P()
    few_kv = dataclasses.replace(cfg, num_kv_heads=2, vocab_size=97)
    assert param_spec(("layers", "0", "wk"), (48, 12), few_kv, 4) == P()  # kv heads replicated
    assert param_spec(("layers", "0", "wq"), (48, 48), few_kv, 4) == P(None, "model")
    assert param_spec(("embed",), (97, 48), few_kv, 4) == P()  # the vocabulary does not divide 4


def test_a_degree_that_does_not_fit_names_the_dimension():
    cfg = dataclasses.replace(TINY, num_heads=8, num_kv_heads=2, intermediate_size=96)
    with pytest.raises(ConfigError, match="num_heads"):
        check_fits(dataclasses.replace(cfg, num_heads=6, num_kv_heads=6), 4)
    with pytest.raises(ConfigError, match="intermediate_size"):
        check_fits(dataclasses.replace(cfg, intermediate_size=90), 4)
    with pytest.raises(ConfigError, match="num_kv_heads = 3"):
        check_fits(dataclasses.replace(cfg, num_heads=12, num_kv_heads=3), 4)
    check_fits(cfg, 4)  # 2 kv heads at degree 4: replicated, fine
    with pytest.raises(ConfigError, match=r"needs 4 devices; JAX sees 1 \(cpu\).*xla_force_host_platform_device_count"):
        make_mesh(2, 2)
    with pytest.raises(ConfigError, match="tensor_parallel must be an integer >= 1"):
        make_mesh(0)
    assert make_mesh(1, 1) is None and mesh_shape(None) == {"data": 1, "model": 1}


def test_generate_rejects_a_degree_that_does_not_fit_before_touching_the_target():
    import eagle_jax

    tgt = tiny_target()  # 4 heads
    with pytest.raises(ConfigError, match="num_heads"):
        eagle_jax.generate(tgt, [[1, 2, 3]], max_new_tokens=2, tensor_parallel=3)
    assert tgt.model.mesh is None
    assert eagle_jax.generate(tgt, [[1, 2, 3]], max_new_tokens=2).stats["mesh"] == {"data": 1, "model": 1}


MESH_CHECKS = """
    import dataclasses, json
    import jax
    from flax import nnx
    from builders import TINY, PROMPTS, tiny_target
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from eagle_jax import TreeConfig, generate, profiles, random_head, steps
    from eagle_jax.engine import engine_for
    from eagle_jax.sampling import SamplingParams
    from eagle_jax.sharding import shard_target

    out = {"devices": len(jax.devices()), "cases": [], "specs": {}, "cache_specs": {}}
    kw = dict(max_new_tokens=10, ignore_eos=True)
    for name, kv in (("kv8", 8), ("kv2", 2)):
        cfg = dataclasses.replace(TINY, num_heads=8, num_kv_heads=kv, head_dim=6, vocab_size=96, num_layers=2)
        # An EAGLE-1 head: it reads the target's (vocabulary-split) lm_head inside the draft loop.
        tgt, head = tiny_target(cfg), random_head(cfg, "eagle1", seed=1)

        def run(tp, dp, tree, **extra):
            shard_target(tgt, tp, dp)
            r = generate(tgt, PROMPTS, head if tree else None, tree=tree, **kw, **extra)
            return r.token_ids, r.stats["mesh"]

        base = {tree: run(1, 1, tree)[0] for tree in (None, "3,2,6")}
        sampled = run(1, 1, "3,2,6", temperature=1.0, seed=3)[0]
        meshes = ((2, 1, {}), (4, 1, {}), (2, 2, {})) if kv == 8 else ((4, 1, {}), (4, 1, {"block_size": 8}))
        for tp, dp, extra in meshes:
            for tree in (None, "3,2,6"):
                before = dict(steps.TRACE_COUNTS)
                ids, mesh = run(tp, dp, tree, **extra)
                again, _ = run(tp, dp, tree, **extra)
                traced = {k: v - before.get(k, 0) for k, v in steps.TRACE_COUNTS.items()}
                out["cases"].append({"model": name, "tp": tp, "dp": dp, "extra": extra, "tree": tree, "mesh": mesh,
                                     "same": ids == base[tree], "again": again == ids, "traced": traced})
        if kv == 8:  # the harness measures and chooses on the mesh, under a profile of the mesh's own
            shard_target(tgt, 4, 1)
            auto = generate(tgt, PROMPTS, head, tree="auto", candidates=["3,2,6"], **kw)
            key4 = profiles.profile_key(tgt, head, [4], ["off", "3,2,6"], 128)
            shard_target(tgt, 1, 1)
            out["auto"] = {"same": auto.token_ids == base[None], "profile": auto.stats["profile"],
                           "keys_differ": key4 != profiles.profile_key(tgt, head, [4], ["off", "3,2,6"], 128)}
        ids, _ = run(2 if kv == 8 else 4, 1, "3,2,6", temperature=1.0, seed=3)
        out["cases"].append({"model": name, "tree": "sampled", "same": ids == sampled, "again": True, "traced": {}})
        shard_target(tgt, 4, 1)
        eng = engine_for(tgt, head)  # the state keeps its layout through a step: caches split by kv head
        st = eng.run_prefill(np.ones((4, 8), np.int32), np.full(4, 8, np.int32), 64, 96, SamplingParams.make(4))
        st, _, _ = eng.run_step(st, SamplingParams.make(4), np.ones(4, bool), TreeConfig(3, 2, 6))
        same = lambda x, *spec: x.sharding.is_equivalent_to(NamedSharding(tgt.model.mesh, P(*spec)), x.ndim)
        out["cache_specs"][name] = [same(st.cache.k[0], None, None, "model" if kv == 8 else None, None),
                                    same(st.draft_cache.k[0]), same(st.root)]
        out["specs"][name] = {jax.tree_util.keystr(k): list(v.sharding.spec)
                              for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(tgt.model))}
    print("RESULT " + json.dumps(out))
"""


def test_greedy_output_on_a_mesh_equals_one_device(tmp_path):
    """TP 2 and 4, DP 2 x TP 2, kv heads split (8) and replicated (2 at degree 4), contiguous and paged
    caches: the same greedy tokens as one device, plain and speculative, one compile per program; a
    sampled speculative run draws the same tokens too (the random bits do not depend on the layout);
    tree="auto" measures its cost profile on the mesh, under a key of its own."""
    out = run_on_fake_devices(MESH_CHECKS, EAGLE_JAX_CACHE=str(tmp_path))  # (the harness's profile goes there)
    assert out["devices"] == 8
    assert out["auto"] == {"same": True, "profile": "measured", "keys_differ": True}
    for case in out["cases"]:
        assert case["same"] and case["again"], case
        if case["tree"] != "sampled":
            assert case["mesh"] == {"data": case["dp"], "model": case["tp"]}
            assert case["traced"] == {"prefill": 1, "step": 1}, case  # the second run compiled nothing
    # After a prefill and a tree step: the target's cache split by kv head (replicated when kv heads are
    # fewer than devices), the draft's cache and the roots replicated over "model".
    assert out["cache_specs"] == {"kv8": [True, True, True], "kv2": [True, True, True]}
    kv8, kv2 = out["specs"]["kv8"], out["specs"]["kv2"]
    assert kv8["['layers'][0]['wq'].value"] == [None, "model"]
    assert kv8["['layers'][0]['wk'].value"] == [None, "model"]
    assert kv2["['layers'][0]['wk'].value"] == []
    assert kv8["['layers'][1]['wo'].value"] == ["model", None]
    assert kv8["['layers'][1]['w_down'].value"] == ["model", None]
    assert kv8["['layers'][1]['w_gate'].value"] == [None, "model"]
    assert kv8["['embed'].value"] == ["model", None]
    assert kv8["['final_norm'].value"] == []


SMOLLM2_TP3 = """
    import json
    import eagle_jax
    from eagle_jax.loader import resolve_draft

    tgt = eagle_jax.load_target("smollm2-135m-instruct", tensor_parallel=3)
    head = resolve_draft("default", tgt)
    prompts = ["Write a haiku about the sea.", "What is 17 * 23? Explain briefly."]
    plain = eagle_jax.generate(tgt, prompts, max_new_tokens=32)
    spec = eagle_jax.generate(tgt, prompts, head, tree="3,4,8", max_new_tokens=32)
    wq = tgt.model.layers[0].wq[...]
    print("RESULT " + json.dumps({"plain": plain.token_ids, "spec": spec.token_ids, "mesh": spec.stats["mesh"],
                                  "wq": list(wq.sharding.spec), "shard": list(wq.addressable_shards[0].data.shape)}))
"""


def test_smollm2_at_tensor_parallel_3_gives_one_devices_greedy_output(smollm2):
    """SmolLM2 (9 heads, 3 kv heads) split 3 ways: the same tokens as one device, plain and speculative."""
    import eagle_jax

    prompts = ["Write a haiku about the sea.", "What is 17 * 23? Explain briefly."]
    reference = eagle_jax.generate(smollm2, prompts, max_new_tokens=32).token_ids
    out = run_on_fake_devices(SMOLLM2_TP3, devices=3)
    assert out["mesh"] == {"data": 1, "model": 3}
    assert out["wq"] == [None, "model"] and out["shard"] == [576, 192]
    assert out["plain"] == reference
    assert out["spec"] == reference


def test_generate_cli_rejects_a_degree_that_does_not_fit(tmp_path):
    from builders import run_main, write_tiny_chat_model
    from eagle_jax.generate import main

    model = write_tiny_chat_model(tmp_path / "tiny")  # 4 heads, 2 kv heads
    bad = run_main(main, "--model", str(model), "--prompt", "hi", "--tensor-parallel", "3")
    assert bad.returncode == 2 and "num_heads (attention heads) = 4" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_cli_across_two_distributed_processes_matches_one(tmp_path):
    """`--distributed`: two processes of 2 CPU devices each run the same steps at TP 4 (gloo collectives;
    kv heads replicated, the vocabulary too); process 0 prints `--json` with the mesh, and its tokens are
    one device's."""
    from builders import write_tiny_chat_model

    model = write_tiny_chat_model(tmp_path / "tiny")
    cmd = [sys.executable, "-m", "eagle_jax.generate", "--model", str(model), "--prompt", "Hello", "--json",
           "--max-new-tokens", "12", "--draft", "random", "--tree", "3,2,6"]
    single = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert single.returncode == 0, single.stderr[-3000:]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_NUM_PROCESSES="2",
               JAX_COORDINATOR_ADDRESS="127.0.0.1:" + str(20000 + (os.getpid() + 7) % 20000))
    procs = [subprocess.Popen(cmd + ["--tensor-parallel", "4", "--distributed"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(env, JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    reports = [[line for line in out.splitlines() if line.startswith("{")] for out, _ in outs]  # (gloo logs too)
    assert len(reports[0]) == 1 and reports[1] == []  # only process 0 reports
    leader = json.loads(reports[0][0])
    assert leader["stats"]["mesh"] == {"data": 1, "model": 4}
    assert leader["token_ids"] == json.loads(single.stdout)["token_ids"]
