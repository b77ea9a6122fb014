"""Mixture-of-Experts MLP math (Mixtral, Qwen3-MoE): routing and the experts' SwiGLU, under static shapes.

A router scores every expert per token; each token goes to its `top_k` best experts, whose outputs are
summed with the routing weights. Both families take the softmax over all experts first, then the top k;
Mixtral always renormalises the k weights to sum to 1, Qwen3-MoE only when `norm_topk_prob` is set.

Three dispatches compute the same thing (up to rounding) with static shapes under jit:
  "gather"   each (token, expert) pair gathers its expert's three matrices and multiplies: only the k
             chosen experts per token are read, the least memory traffic when N * k is below E, as in
             single-row decoding (but N * k weight copies, so it loses as N grows).
  "dense"    every expert runs on every token and the routing weights (zero outside the top k) mix the
             outputs: E / k times the arithmetic, but three batched matmuls and no data movement.
  "grouped"  the N * k (token, expert) pairs are sorted by expert and each expert's contiguous group goes
             through one `jax.lax.ragged_dot`: arithmetic follows the pairs, not E.
`dispatch_for(tokens, top_k, num_experts)` picks one per shape from what `benchmarks/moe_dispatch.py`
measured. On XLA:CPU (hidden 576, 8 experts of 768, top 2): "gather" at 1 token (1.0 ms against 1.4 for
"dense"), "dense" from 4 tokens to 512 (1.4 ms at 4, 57 ms at 512), "grouped" never (`ragged_dot` is
not a native grouped matmul there: 14 ms at 1 token, 104 ms at 512). On accelerators, where
`ragged_dot` is a grouped matmul, "grouped" takes over past GROUPED_ABOVE_PAIRS_PER_EXPERT pairs per
expert (a threshold not yet measured on GPU or TPU hardware).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DISPATCHES = ("gather", "dense", "grouped")
GATHER_UP_TO = 0.25  # pairs per expert: "gather" while the pairs read at most a quarter of the experts
GROUPED_ABOVE_PAIRS_PER_EXPERT = 4


def dispatch_for(tokens: int, top_k: int, num_experts: int, backend: str | None = None) -> str:
    """The dispatch for a static token count on a backend (default: JAX's)."""
    pairs_per_expert = tokens * top_k / num_experts
    if pairs_per_expert <= GATHER_UP_TO:
        return "gather"
    if (backend or jax.default_backend()) == "cpu" or pairs_per_expert <= GROUPED_ABOVE_PAIRS_PER_EXPERT:
        return "dense"
    return "grouped"


def route(h, router, top_k: int, norm_topk: bool):
    """(weights [N, k] in h's dtype, experts [N, k] int32) for tokens h [N, H] and router [H, E]."""
    logits = jnp.einsum("NH,HE->NE", h, router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(h.dtype), experts.astype(jnp.int32)


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


def experts_dense(h, weights, experts, we_gate, we_up, we_down):
    """Every expert on every token, mixed by the routing weights. h [N, H]; we_gate / we_up [E, H, F];
    we_down [E, F, H]."""
    mix = jnp.zeros((h.shape[0], we_gate.shape[0]), h.dtype)
    mix = mix.at[jnp.arange(h.shape[0])[:, None], experts].add(weights)  # [N, E], zero outside the top k
    # A batched matmul over the expert axis: contracting [N, H] straight against [E, H, F] makes XLA:CPU
    # transpose every expert's weights on each call (ten times slower at one token).
    x = jnp.broadcast_to(h, (we_gate.shape[0],) + h.shape)  # [E, N, H]
    act = _swiglu(jnp.einsum("ENH,EHF->ENF", x, we_gate), jnp.einsum("ENH,EHF->ENF", x, we_up))
    out = jnp.einsum("ENF,EFH->ENH", act, we_down)
    return jnp.einsum("ENH,NE->NH", out, mix)


def experts_gather(h, weights, experts, we_gate, we_up, we_down):
    """Each (token, expert) pair with its own expert's matrices, gathered."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    x = jnp.repeat(h, k, axis=0)  # [N * k, H], pair p = token p // k
    act = _swiglu(jnp.einsum("PH,PHF->PF", x, jnp.take(we_gate, flat, axis=0)),
                  jnp.einsum("PH,PHF->PF", x, jnp.take(we_up, flat, axis=0)))
    out = jnp.einsum("PF,PFH->PH", act, jnp.take(we_down, flat, axis=0)) * weights.reshape(-1, 1)
    return out.reshape(n, k, -1).sum(axis=1)


def experts_grouped(h, weights, experts, we_gate, we_up, we_down):
    """The (token, expert) pairs sorted by expert, each expert's group through `jax.lax.ragged_dot`."""
    n, k = experts.shape
    num_experts = we_gate.shape[0]
    flat = experts.reshape(-1)  # [N * k]
    order = jnp.argsort(flat, stable=True)
    tokens = order // k  # the token of each sorted pair
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    x = jnp.take(h, tokens, axis=0)  # [N * k, H]
    act = _swiglu(jax.lax.ragged_dot(x, we_gate, sizes), jax.lax.ragged_dot(x, we_up, sizes))
    out = jax.lax.ragged_dot(act, we_down, sizes)  # [N * k, H], sorted order
    out = out * jnp.take(weights.reshape(-1), order)[:, None]
    return jnp.zeros_like(h).at[tokens].add(out)


def moe_mlp(h, router, we_gate, we_up, we_down, *, top_k: int, norm_topk: bool, dispatch: str | None = None):
    """The MoE MLP of h [..., H] (any leading axes): route, run the experts, mix. dispatch None: by shape."""
    lead, hidden = h.shape[:-1], h.shape[-1]
    flat = h.reshape(-1, hidden)
    dispatch = dispatch or dispatch_for(flat.shape[0], top_k, we_gate.shape[0])
    if dispatch not in DISPATCHES:
        raise ValueError(f"MoE dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    weights, experts = route(flat, router, top_k, norm_topk)
    run = {"gather": experts_gather, "dense": experts_dense, "grouped": experts_grouped}[dispatch]
    return run(flat, weights, experts, we_gate, we_up, we_down).reshape(*lead, hidden)
