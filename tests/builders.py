"""Builders shared by the tests: tiny random targets and heads (JAX), tiny random transformers models
(torch) and their GGUF twins, and the prompts the engine tests decode.

Test modules import from here (never from each other); `conftest.py` wraps the common ones as fixtures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eagle_jax import profiles
from eagle_jax.config import ModelConfig
from eagle_jax.draft import random_head
from eagle_jax.loader import Target
from eagle_jax.model import random_model
from eagle_jax.tree import parse_tree, tree_name

# --- command-line entry points ---------------------------------------------------------------------------


@dataclasses.dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_main(main, *args) -> CliResult:
    """A CLI's `main(argv)` called in this process, as `python -m ...` would run it, with its exit code and
    output. An exception other than the exit propagates and fails the test: a clear error is an exit code
    and a message, never a traceback. The CLIs' subprocess paths (runpy, `sys.exit`) are the documented
    commands' tests (test_docs.py) and the `--help` checks."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse's errors and --help
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return CliResult(rc, out.getvalue(), err.getvalue())


# --- JAX targets and heads -------------------------------------------------------------------------------

TINY = ModelConfig(arch="llama", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=12, max_position=512)
SMALL_VOCAB = dataclasses.replace(TINY, vocab_size=12, num_layers=1)
TRAIN_CFG = dataclasses.replace(TINY, num_layers=4)  # the trainer tests' target

PROMPTS = [[5, 9, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8], [42], [7, 7, 7, 7, 7, 7]]
MORE_PROMPTS = PROMPTS + [[8, 6, 7, 5, 3, 0, 9], [13] * 11, [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34],
                          [90, 1]]


def tiny_target(cfg=TINY, seed=0, eos=()):
    model = random_model(cfg, seed=seed)
    # Sharper logits than the 0.02 init gives, so greedy and sampling differ visibly.
    model.embed[...] = model.embed[...] * 25.0
    return Target(model=model, tokenizer=None, name="tiny", source="random")


def oracle_pair(cfg=dataclasses.replace(TINY, num_layers=1), attn_scale=0.5, seed=0):
    """A one-layer target and an EAGLE-1 head that nearly reproduces it.

    The head passes the token embedding through fc, skips attention and copies the target's MLP, so
    it predicts the target's pre-norm hidden state up to the target's (down-scaled) attention term.
    With all-ones final norm the lm_head ranks tokens the same, so drafts are usually accepted: the
    tests exercise deep acceptance, multi-row commits and draft refreshes, not just rejections.
    """
    tgt = tiny_target(cfg, seed=seed)
    blk = tgt.model.layers[0]
    blk.wo[...] = blk.wo[...] * attn_scale
    tgt.model.final_norm[...] = jnp.ones_like(tgt.model.final_norm[...])
    head = random_head(cfg, "eagle1", seed=seed)
    h = cfg.hidden_size
    fc = np.zeros((2 * h, h), np.float32)
    fc[:h] = np.eye(h)
    head.fc[...] = jnp.asarray(fc)
    head.fc_bias[...] = jnp.zeros((h,))
    head.wo[...] = jnp.zeros_like(head.wo[...])
    for name in ("w_gate", "w_up", "w_down"):
        getattr(head, name)[...] = getattr(blk, name)[...]
    head.post_norm[...] = blk.mlp_norm[...]
    return tgt, head


def train_setup(n_prompts=96):
    """A tiny target with a peaked next-token distribution and rows of its own greedy answers."""
    import eagle_jax

    tgt = tiny_target(TRAIN_CFG)
    tgt.model.lm_head[...] = tgt.model.lm_head[...] * 15
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TRAIN_CFG.vocab_size, size=rng.integers(2, 6)).tolist() for _ in range(n_prompts)]
    r = eagle_jax.generate(tgt, prompts, max_new_tokens=24)
    rows = [(np.asarray(p + t, np.int32), np.asarray([0] * len(p) + [1] * len(t), np.uint8))
            for p, t in zip(prompts, r.token_ids)]
    return tgt, rows


def write_profile(directory, tgt, head, b, s_len, extra, seconds, candidates=None):
    """Writes a cost profile where the harness will find it (a synthetic one: the choice it forces is
    the point, not this machine's numbers). `seconds(tree or None)` gives each candidate's step time;
    candidates: the harness's trees (default `harness.DEFAULT_CANDIDATES`). Written under the keys of
    both program kinds (the general steps, and the all-greedy ones an all-greedy call profiles)."""
    from eagle_jax import harness

    cands = [None] + harness.candidate_trees(candidates)
    names = [tree_name(t) for t in cands]
    for sampling in (True, False):
        key = profiles.profile_key(tgt, head, [b], names, s_len, sampling)
        prof = profiles.Profile(key, {b: {n: seconds(parse_tree(n)) for n in names}}, meta={})
        (directory / f"{key}.json").write_text(json.dumps(prof.to_json()))


def write_tiny_chat_model(directory, **shape):
    """A tiny random Llama with a character tokenizer and a chat template, as a Hugging Face directory:
    what `benchmarks/serve_load.py --smoke` serves. CLI tests whose point is the command, not the
    real target's numbers, run on it (a SmolLM2 process compiles for minutes on a fresh cache)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_tiny_model(Path(directory), **shape)  # shape: heads=, kv_heads=


# --- transformers models and GGUF files --------------------------------------------------------------------

HF_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def make_tiny_hf(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random `{arch}ForCausalLM` in eval mode, every parameter randomised.

    Norm weights are drawn around 1 and biases around 0 but never equal to them, so a loader that
    drops or misplaces a norm or a bias shows up in the logits.
    """
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**HF_TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def run_on_fake_devices(code: str, devices: int = 8, timeout: int = 600, **env_extra) -> dict:
    """Runs `code` in a Python with `devices` CPU devices; it prints one JSON line starting with RESULT."""
    import os
    import subprocess
    import sys
    import textwrap

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([str(root / "tests"), str(root)]), **env_extra)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=root)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def two_sample_p(a, b, vocab: int) -> float:
    """Chi-square p-value that two samples of token pairs (x, y) over `vocab` come from one distribution."""
    from scipy.stats import chi2_contingency

    idx = lambda pairs: np.asarray([x * vocab + y for x, y in pairs])
    ca, cb = np.bincount(idx(a), minlength=vocab * vocab), np.bincount(idx(b), minlength=vocab * vocab)
    keep = (ca + cb) > 0
    return chi2_contingency(np.stack([ca[keep], cb[keep]]))[1]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute: interleaves the two rotary halves.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(cfg) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: per-frequency divisors.
    rope = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_llama_gguf(model, path, *, vocab_size_key: bool = True, block_types: dict | None = None) -> None:
    """Writes a transformers Llama (or Mixtral) as an F32 GGUF laid out like llama.cpp's converter output:
    Mixtral is architecture "llama" with expert counts, a router (ffn_gate_inp) and each layer's experts
    stacked into ffn_{gate,up,down}_exps. block_types: {part of a tensor name: GGUF block type}, e.g.
    {"attn_q": "Q4_0", "token_embd": "Q8_0"}: those tensors are written quantized by `gguf.quants`."""
    import gguf

    cfg = model.config
    experts = getattr(cfg, "num_local_experts", 0) or 0
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if experts:  # transformers keeps experts fused in memory; its saved checkpoint has them one by one
        import tempfile

        from safetensors.numpy import load_file

        with tempfile.TemporaryDirectory() as saved:
            model.save_pretrained(saved)
            sd = {k: v.astype(np.float32) for f in sorted(Path(saved).glob("*.safetensors"))
                  for k, v in load_file(str(f)).items()}
    w = gguf.GGUFWriter(str(path), "llama")
    plain_add = w.add_tensor

    def add_tensor(name, arr):
        kind = next((t for part, t in (block_types or {}).items() if part in name), None)
        if kind is None:
            return plain_add(name, arr)
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        plain_add(name, gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype), raw_dtype=qtype)

    w.add_tensor = add_tensor
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if vocab_size_key:
        w.add_vocab_size(cfg.vocab_size)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    # add_tensor takes numpy-ordered arrays and writes GGUF's reversed (fastest-first) dims itself.
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    if cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight",
                     _llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight",
                     _llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if experts:
            moe = p + "block_sparse_moe."
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd[moe + "gate.weight"])
            for name, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                w.add_tensor(f"blk.{i}.ffn_{name}_exps.weight",
                             np.stack([sd[f"{moe}experts.{e}.{hf}.weight"] for e in range(experts)]))
            continue
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def memory_maps() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's per-process limit), or None off Linux."""
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except OSError:
        return None


def release_compiled_code(fraction: float = 0.5) -> bool:
    """Drops JAX's caches (freeing their compiled executables) once this process holds more than
    `fraction` of the kernel's per-process memory mappings; True if it did.

    Every XLA:CPU executable keeps about six mappings until its jit cache entry goes. A pytest worker
    that runs a few hundred tests compiles thousands of executables; it reached vm.max_map_count
    (65530), the next mmap inside XLA failed, and the worker died with a segmentation fault in
    compilation or while serialising an executable. Later tests compile what they need again."""
    maps = memory_maps()
    if maps is None or maps[0] <= maps[1] * fraction:
        return False
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    return True


def tree_verify_vs_hf(target, model, prompt, n: int = 7, seed: int = 0) -> float:
    """Relative error between one tree-verify forward (the prompt prefilled, then `n` tree tokens of a random
    tree under its ancestor mask, each at its depth's position) and transformers run on each node's own
    path (prompt + ancestors + node), at every node."""
    import torch

    rng = np.random.default_rng(seed)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    mask = np.zeros((n, n), bool)
    depth = np.zeros(n, np.int32)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i], depth[i] = mask[p], depth[p] + 1
        mask[i, i] = True
    tokens = rng.integers(0, target.cfg.vocab_size, n)
    cache = target.model.init_cache(1, 64)
    cache = target.model(jnp.asarray([prompt], jnp.int32), cache).cache
    cache = cache.replace(lengths=cache.lengths + len(prompt))
    ours = np.asarray(target.model(jnp.asarray([tokens], jnp.int32), cache,
                                   positions=jnp.asarray([len(prompt) + depth]), tree_mask=jnp.asarray([mask])).logits[0])
    worst = 0.0
    for i in range(n):
        path = list(prompt) + [int(tokens[j]) for j in np.flatnonzero(mask[i])]  # ancestors in order: their depths rise
        with torch.no_grad():
            ref = model(torch.tensor([path])).logits[0, -1].float().numpy()
        worst = max(worst, float(np.abs(ours[i] - ref).max() / np.abs(ref).max()))
    assert len(set(depth.tolist())) > 2  # a tree several levels deep, not a chain or a fan
    return worst


def cli_texts_plain_and_random_head(model_dir) -> list[dict]:
    """`python -m eagle_jax.generate --json` on model_dir, plain and with `--draft random --tree 3,2,6`: both
    outputs (a random head is lossless, so the two must match)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "eagle_jax.generate", "--model", str(model_dir), "--prompt", "Hello there",
           "--max-new-tokens", "16", "--json"]
    outs = []
    for extra in ([], ["--draft", "random", "--tree", "3,2,6"]):
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(json.loads(proc.stdout))
    return outs
