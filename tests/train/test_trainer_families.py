"""EAGLE-3 heads trained over the newer target families (a MoE target, a Gemma 3 target with sliding
windows): the loss falls, held-out acceptance rises, the head exported in the official layout loads back
and speculates losslessly with more than one token per step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import eagle_jax
from builders import TRAIN_CFG, tiny_target
from eagle_jax.config import RopeConfig
from eagle_jax.draft import load_draft, random_head
from eagle_jax.train.trainer import OptimConfig, Trainer, export

FAMILIES = {
    "moe": dataclasses.replace(TRAIN_CFG, arch="mixtral", num_experts=4, experts_per_token=2, expert_size=48),
    "gemma3": dataclasses.replace(
        TRAIN_CFG, arch="gemma3_text", qk_norm=True, norm_offset=1.0, activation="gelu_tanh", sandwich_norms=True,
        embed_scale=TRAIN_CFG.hidden_size ** 0.5, query_scale=0.2, local_rope=RopeConfig(theta=100.0),
        layer_types=("sliding_attention", "full_attention") * (TRAIN_CFG.num_layers // 2), sliding_window=8),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_eagle3_head_trains_exports_and_speculates_over_the_family(family, tmp_path):
    cfg = FAMILIES[family]
    tgt = tiny_target(cfg)
    tgt.model.lm_head[...] = tgt.model.lm_head[...] * 15  # a peaked next-token distribution: learnable
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=rng.integers(2, 6)).tolist() for _ in range(64)]
    answers = eagle_jax.generate(tgt, prompts, max_new_tokens=24).token_ids  # past the 8-key window
    rows = [(np.asarray(p + t, np.int32), np.asarray([0] * len(p) + [1] * len(t), np.uint8))
            for p, t in zip(prompts, answers)]
    head = random_head(cfg, "eagle3", seed=0, draft_vocab_size=97)
    tr = Trainer(tgt, head, OptimConfig(steps=120, lr=3e-3, warmup_steps=10, batch_size=8, seq_len=32, ttt_length=2,
                                        log_every=10, eval_every=120))
    before = tr.evaluate(rows[56:])
    hist = tr.train(rows[:56], eval_rows=rows[56:])
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert hist[-1]["eval_acc"][0] > before[0] + 0.2, (before, hist[-1]["eval_acc"])
    export(tr, tmp_path / "head")
    trained = load_draft(tmp_path / "head", cfg)  # the official EAGLE-3 layout, read back
    test_prompts = prompts[56:60]
    plain = eagle_jax.generate(tgt, test_prompts, max_new_tokens=20)
    spec = eagle_jax.generate(tgt, test_prompts, trained, tree="3,4,8", max_new_tokens=20)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["tau"] > 1.2, spec.stats["tau"]  # the trained head's drafts are accepted
