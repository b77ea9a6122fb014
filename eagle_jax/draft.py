"""EAGLE draft heads (Flax NNX) and their official checkpoint layouts.

EAGLE-1/2 head ("eagle1"): h = fc([embed(token_{t+1}); feature_t]) (2H -> H, with bias), then one
Llama decoder layer without its input norm; h predicts the target's next feature (the final normed
hidden state) and token logits come from the target's own lm_head.

EAGLE-3 head ("eagle3"): the target feature is the concatenation of the residual stream after a low,
a middle and a high layer; fc (3H -> H, no bias) fuses it. The decoder layer ("midlayer") attends over
[input_norm(embed(token)); hidden_norm(h)] (2H wide q/k/v inputs), and its output h is fed back
as the next step's feature during drafting (fc is applied to target features only). Logits come from
the head's own lm_head over a reduced draft vocabulary; draft id i is target id i + d2t[i] (a one-to-one
map into the target vocabulary: `save_draft` and `load_draft` refuse any other, see `d2t_problem`).

Both heads share the target's (frozen) token embedding. A head keeps its own one-layer KV cache.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.config import ModelConfig, RopeConfig, rope_from_hf
from eagle_jax.kv_cache import KVCache
from eagle_jax.layers import cached_attention, causal_mask, layer_tail, param_factories, project_qkv, rms_norm
from eagle_jax.weights import fill

KINDS = ("eagle1", "eagle3")


class DraftLoadError(ValueError):
    """A draft-head checkpoint could not be loaded; the message names the file and tensor."""


def d2t_problem(d2t, vocab_size: int) -> str | None:
    """What makes an EAGLE-3 vocabulary map unusable, or None when it is fine.

    Draft id i stands for target id i + d2t[i]. Every target id must lie in [0, vocab_size), and no two
    draft ids may share one: the draft's top-k siblings would then carry the same target token, and the
    acceptance rule (`eagle_jax.accept`) is exact only for siblings with distinct tokens.
    """
    d2t = np.asarray(d2t).astype(np.int64).reshape(-1)
    target = np.arange(d2t.size) + d2t
    outside = np.flatnonzero((target < 0) | (target >= vocab_size))
    if outside.size:
        i = int(outside[0])
        return (f"draft id {i} maps to target id {int(target[i])}, outside the target vocabulary [0, {vocab_size})"
                f" ({outside.size} draft id{'s' if outside.size > 1 else ''} out of range)")
    order = np.argsort(target, kind="stable")
    same = np.flatnonzero(np.diff(target[order]) == 0)
    if same.size:
        i, j = int(order[same[0]]), int(order[same[0] + 1])
        return (f"draft ids {i} and {j} both map to target id {int(target[i])} ({same.size} draft "
                f"id{'s' if same.size > 1 else ''} repeat a target id of another); the map must be one-to-one")
    return None


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / middle / high target layers whose outputs EAGLE-3 fuses (0-based layer outputs)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    kind: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    draft_vocab_size: int = 0  # eagle3 only
    aux_layers: tuple[int, ...] = ()  # eagle3 only
    fc_bias: bool = True  # eagle1 only
    max_position: int = 4096

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"draft kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "eagle3":
            if not 0 < self.draft_vocab_size <= self.vocab_size:
                raise ValueError(f"draft_vocab_size must be in (0, {self.vocab_size}], got {self.draft_vocab_size}")
            if len(self.aux_layers) != 3:
                raise ValueError(f"eagle3 needs 3 aux_layers (low, mid, high), got {self.aux_layers}")

    @property
    def feature_size(self) -> int:
        """Width of the target features the head consumes."""
        return self.hidden_size * (3 if self.kind == "eagle3" else 1)

    @classmethod
    def for_target(cls, target: ModelConfig, kind: str = "eagle3", draft_vocab_size: int | None = None,
                   aux_layers=None) -> "DraftConfig":
        return cls(
            kind=kind,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope=target.rope,
            draft_vocab_size=(draft_vocab_size or min(32000, target.vocab_size)) if kind == "eagle3" else 0,
            aux_layers=tuple(aux_layers or default_aux_layers(target.num_layers)) if kind == "eagle3" else (),
            fc_bias=kind == "eagle1",
            max_position=target.max_position,
        )


class Buffer(nnx.Variable):
    """Non-trainable arrays that belong to the checkpoint (the EAGLE-3 vocabulary maps)."""


class DraftHead(nnx.Module):
    def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        H, F = cfg.hidden_size, cfg.intermediate_size
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        w, ones, _ = param_factories(rngs, dtype)
        attn_in = 2 * H if cfg.kind == "eagle3" else H
        fc_in = 3 * H if cfg.kind == "eagle3" else 2 * H
        self.fc = w(fc_in, H)
        if cfg.fc_bias:
            self.fc_bias = nnx.Param(jnp.zeros((H,), dtype))
        if cfg.kind == "eagle3":
            self.input_norm = ones(H)
            self.hidden_norm = ones(H)
            self.norm = ones(H)
            self.lm_head = w(H, cfg.draft_vocab_size)
            # Identity maps until a vocabulary is chosen: draft id i is target id i.
            self.d2t = Buffer(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))
        self.wq, self.wk, self.wv = w(attn_in, qd), w(attn_in, kd), w(attn_in, kd)
        self.wo = w(qd, H)
        self.post_norm = ones(H)
        self.w_gate, self.w_up = w(H, F), w(H, F)
        self.w_down = w(F, H)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache.create(1, batch, max_len, c.num_kv_heads, c.head_dim, self.dtype)

    def __call__(self, target, feats, tokens, cache: KVCache, *, fuse: bool, positions=None, tree_mask=None,
                 write_offset=0):
        """One draft layer over T inputs per row.

        feats [B, T, F]: target features (fuse=True; F = feature_size) or the head's own outputs
        (fuse=False; F = H). tokens [B, T]: the token that follows each feature. Writes K/V at each
        row's [length + write_offset, ... + T) without committing; the queries see the committed prefix
        and the scratch keys [length, length + M) chosen by tree_mask [B, T, M] (default: causal over
        the T new tokens). Returns (h [B, T, H], cache).
        """
        b, t = tokens.shape
        if positions is None:
            positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if tree_mask is None:
            tree_mask = jnp.broadcast_to(causal_mask(t), (b, t, t))
        residual, attn_in = self.inputs(target, feats, tokens, fuse=fuse)
        q, k, v = self.qkv(attn_in, positions)
        attn, k_cache, v_cache = cached_attention(q, k, v, cache.k[0], cache.v[0], starts=cache.lengths + write_offset,
                                                  lengths=cache.lengths, tree_mask=tree_mask, table=cache.table,
                                                  mesh=getattr(target, "mesh", None), split_heads=False)
        return self.finish(residual, attn), cache.replace(k=(k_cache,), v=(v_cache,))

    # The layer in three pieces, so training can run the same math with its own attention pattern.
    def inputs(self, target, feats, tokens, *, fuse: bool):
        """(residual [B,T,H], attention input [B,T,H or 2H]) for feature / token pairs."""
        c = self.cfg
        emb = target.embed_tokens(tokens).astype(self.dtype)
        feats = feats.astype(self.dtype)
        if c.kind == "eagle1":
            h = jnp.concatenate([emb, feats], axis=-1) @ self.fc[...]
            if c.fc_bias:
                h = h + self.fc_bias[...]
            return h, h  # layer 0 of an EAGLE-1 head has no input norm
        h = feats @ self.fc[...] if fuse else feats
        attn_in = jnp.concatenate([rms_norm(emb, self.input_norm[...], c.rms_norm_eps),
                                   rms_norm(h, self.hidden_norm[...], c.rms_norm_eps)], axis=-1)
        return h, attn_in

    def qkv(self, attn_in, positions):
        c = self.cfg
        return project_qkv(attn_in, self.wq[...], self.wk[...], self.wv[...], num_heads=c.num_heads,
                           num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, positions=positions, rope=c.rope)

    def finish(self, residual, attn):
        """Output projection and MLP; attn [B, T, Hq, D]."""
        c = self.cfg
        return layer_tail(residual, attn, self.wo[...], self.post_norm[...], self.w_gate[...], self.w_up[...],
                          self.w_down[...], c.rms_norm_eps)

    def logprobs(self, target, h):
        """Log-probabilities over the head's vocabulary [..., V_draft] (the target's for eagle1)."""
        if self.cfg.kind == "eagle1":
            logits = target.logits(h)
        else:
            logits = jnp.einsum("...H,HV->...V", rms_norm(h, self.norm[...], self.cfg.rms_norm_eps),
                                self.lm_head[...], preferred_element_type=jnp.float32)
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    def to_target_ids(self, draft_ids):
        if self.cfg.kind == "eagle1":
            return draft_ids
        return draft_ids + jnp.take(self.d2t[...], draft_ids)


def random_head(target_cfg: ModelConfig, kind: str = "eagle3", seed: int = 0, dtype=jnp.float32,
                draft_vocab_size: int | None = None) -> DraftHead:
    """An untrained head shaped for `target_cfg` (tests; the starting point for training)."""
    return DraftHead(DraftConfig.for_target(target_cfg, kind, draft_vocab_size), rngs=nnx.Rngs(seed), dtype=dtype)


# --- official checkpoint layouts --------------------------------------------------------------

# (checkpoint name, attribute, transpose)
_COMMON = (
    ("self_attn.q_proj.weight", "wq", True),
    ("self_attn.k_proj.weight", "wk", True),
    ("self_attn.v_proj.weight", "wv", True),
    ("self_attn.o_proj.weight", "wo", True),
    ("post_attention_layernorm.weight", "post_norm", False),
    ("mlp.gate_proj.weight", "w_gate", True),
    ("mlp.up_proj.weight", "w_up", True),
    ("mlp.down_proj.weight", "w_down", True),
)
EAGLE1_TABLE = (("fc.weight", "fc", True), ("fc.bias", "fc_bias", False)) + tuple(
    ("layers.0." + n, a, t) for n, a, t in _COMMON)
EAGLE1_UNUSED = ("layers.0.input_layernorm.weight", "embed_tokens.weight")
EAGLE3_TABLE = (
    ("fc.weight", "fc", True),
    ("midlayer.input_layernorm.weight", "input_norm", False),
    ("midlayer.hidden_norm.weight", "hidden_norm", False),
    ("norm.weight", "norm", False),
    ("lm_head.weight", "lm_head", True),
    ("d2t", "d2t", False),
) + tuple(("midlayer." + n, a, t) for n, a, t in _COMMON)
EAGLE3_UNUSED = ("t2d", "embed_tokens.weight")


def _table(kind):
    return (EAGLE1_TABLE, EAGLE1_UNUSED) if kind == "eagle1" else (EAGLE3_TABLE, EAGLE3_UNUSED)


def head_config_json(cfg: DraftConfig) -> dict:
    out = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    if cfg.rope.kind != "default":
        out["rope_scaling"] = {"rope_type": cfg.rope.kind, "factor": cfg.rope.factor,
                               "low_freq_factor": cfg.rope.low_freq_factor,
                               "high_freq_factor": cfg.rope.high_freq_factor,
                               "original_max_position_embeddings": cfg.rope.original_max_position}
    if cfg.kind == "eagle3":
        out["architectures"] = ["LlamaForCausalLMEagle3"]
        out["draft_vocab_size"] = cfg.draft_vocab_size
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers)}
    else:
        out["architectures"] = ["LlamaForCausalLM"]
        out["bias"] = cfg.fc_bias
    return out


def save_draft(head: DraftHead, path, dtype="float32") -> Path:
    """Writes config.json + model.safetensors in the official EAGLE / EAGLE-3 layout.

    `dtype` is the storage type of the float tensors: "float32" or "bfloat16" (half the size; the
    shipped heads use it). `load_draft` casts to the requested compute dtype either way.
    """
    import ml_dtypes
    from safetensors.numpy import save_file

    store = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}.get(str(np.dtype(dtype)) if not
                                                                         isinstance(dtype, str) else dtype)
    if store is None:
        raise ValueError(f"save_draft: dtype must be 'float32' or 'bfloat16', got {dtype!r}")

    cfg = head.cfg
    if cfg.kind == "eagle3":
        problem = d2t_problem(head.d2t[...], cfg.vocab_size)
        if problem is not None:  # load_draft would refuse the file (and t2d below would be wrong)
            raise ValueError(f"save_draft: head.d2t is not a usable vocabulary map: {problem}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    table, _ = _table(cfg.kind)
    tensors = {}
    for name, attr, transpose in table:
        if not hasattr(head, attr):
            continue
        arr = np.asarray(getattr(head, attr)[...])
        if attr == "d2t":
            arr = arr.astype(np.int64)
        else:
            arr = arr.astype(np.float32).astype(store)
        tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
    if cfg.kind == "eagle3":
        d2t = np.asarray(head.d2t[...]).astype(np.int64)
        t2d = np.zeros((cfg.vocab_size,), bool)
        t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
        tensors["t2d"] = t2d
    else:
        tensors["layers.0.input_layernorm.weight"] = np.ones((cfg.hidden_size,), store)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(head_config_json(cfg), indent=2))
    return path


def load_draft(path, target_cfg: ModelConfig | None = None, dtype=jnp.float32) -> DraftHead:
    """Loads an EAGLE-1/2 or EAGLE-3 head from an official-layout directory."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg_path, weights = path / "config.json", path / "model.safetensors"
    for f in (cfg_path, weights):
        if not f.exists():
            raise DraftLoadError(f"{path}: missing {f.name} (expected an EAGLE head directory)")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise DraftLoadError(f"{cfg_path}: invalid JSON ({e})") from None
    try:
        handle = safe_open(str(weights), framework="numpy")
        names = set(handle.keys())
    except (SafetensorError, OSError) as e:
        raise DraftLoadError(f"{weights}: cannot read safetensors file (truncated or corrupt?): {e}") from None
    kind = "eagle3" if any(n.startswith("midlayer.") for n in names) else "eagle1"
    try:
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if kind == "eagle3" and aux is None:
            if target_cfg is None:
                raise DraftLoadError(f"{cfg_path}: no eagle_config.eagle_aux_hidden_state_layer_ids; "
                                     "pass target_cfg to use the default layers")
            aux = default_aux_layers(target_cfg.num_layers)
        cfg = DraftConfig(
            kind=kind,
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope_from_hf(hf, str(cfg_path)),
            draft_vocab_size=int(hf.get("draft_vocab_size") or hf["vocab_size"]) if kind == "eagle3" else 0,
            aux_layers=tuple(int(a) for a in aux) if kind == "eagle3" else (),
            fc_bias="fc.bias" in names if kind == "eagle1" else False,
            max_position=int(hf.get("max_position_embeddings", 4096)),
        )
    except (KeyError, ValueError, TypeError) as e:
        if isinstance(e, DraftLoadError):
            raise
        raise DraftLoadError(f"{cfg_path}: invalid draft config: {e!r}") from None
    if target_cfg is not None:
        if cfg.hidden_size != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
            raise DraftLoadError(
                f"{path}: head is for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, but the target has "
                f"hidden {target_cfg.hidden_size} / vocab {target_cfg.vocab_size}")
    head = nnx.eval_shape(lambda: DraftHead(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    table, unused = _table(kind)
    shapes = {attr: tuple(getattr(head, attr).shape) for _, attr, _ in table if hasattr(head, attr)}
    arrays = fill(table, shapes, sorted(names), handle.get_tensor, lambda n: handle.get_slice(n).get_shape(),
                  source=str(weights), error=DraftLoadError, kind=f"an {kind} head", ignored=unused,
                  describe=lambda attr: attr)
    for attr, arr in arrays.items():
        if attr == "d2t":
            problem = d2t_problem(arr, cfg.vocab_size)
            if problem is not None:
                raise DraftLoadError(f"{weights}: tensor 'd2t' is not a usable draft-to-target vocabulary map: "
                                     f"{problem}")
            getattr(head, attr).set_value(jnp.asarray(arr, jnp.int32))
        else:  # bf16 storage -> float32, then the compute dtype
            getattr(head, attr).set_value(jnp.asarray(arr.astype(np.float32), dtype))
    return head
