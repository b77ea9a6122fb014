"""Tensor and data parallelism for inference: a target sharded over a `jax.sharding.Mesh`.

The mesh has two axes, or three for a MoE target split by experts: "data" splits batch rows, "expert"
(only when expert_parallel > 1) splits a MoE layer's experts, and "model" splits the target's math
(Megatron-style):
  - attention: q heads over "model" (wq's columns, wo's rows); k / v heads over "model" where the kv
    heads divide the degree, else replicated (every shard then holds all kv heads and its q heads read
    the one they group with, which needs the degree to be a multiple of the kv heads);
  - MLP: the intermediate dimension (w_gate / w_up columns, w_down rows); a MoE layer's experts
    [E, H, F] / [E, F, H] split E over "expert" and F over "model", its router replicated;
  - vocabulary: the embedding's rows and the lm_head's columns (replicated when the vocabulary does not
    divide the degree);
  - KV cache: by kv head, as k / v (contiguous caches [B, S, K, D] also split rows over "data"; paged
    pools [P, block, K, D] are shared by all rows, so a paged cache needs data parallelism 1).
The draft head is replicated (it is a few percent of the target's weights; its matmuls are too small
to gain from splitting, and a replicated head needs no collectives inside the draft loop).

Everything but attention is partitioned by XLA (GSPMD) from the parameters' and state's shardings;
attention runs per shard (`shard_map` in `layers.cached_attention`), so the Pallas kernels see one
shard's heads. The step family puts its outputs back on the layout `state_shardings` gives, so every
step runs one program per shape.

Multi-host: `initialize()` joins the processes (`jax.distributed`); the mesh then spans every process's
devices, and each process runs the same steps on its shards.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eagle_jax.config import ConfigError
from eagle_jax.kv_cache import KVCache

DATA, EXPERT, MODEL = "data", "expert", "model"


def make_mesh(tensor_parallel: int = 1, data_parallel: int = 1, devices=None, expert_parallel: int = 1) -> Mesh | None:
    """A ("data", "model") mesh of data_parallel x tensor_parallel devices, or ("data", "expert", "model")
    with expert_parallel > 1 (the first ones of `devices`, default every device of every process); None for
    one device (nothing to shard)."""
    for name, v in (("tensor_parallel", tensor_parallel), ("data_parallel", data_parallel),
                    ("expert_parallel", expert_parallel)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    n = tensor_parallel * data_parallel * expert_parallel
    if n == 1:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < n:
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)"
                if devices and devices[0].platform == "cpu" else "")
        raise ConfigError(f"data_parallel {data_parallel} x expert_parallel {expert_parallel} x tensor_parallel "
                          f"{tensor_parallel} needs {n} devices; "
                          f"JAX sees {len(devices)} ({devices[0].platform if devices else 'none'}){hint}")
    if expert_parallel == 1:
        grid = np.asarray(devices[:n], dtype=object).reshape(data_parallel, tensor_parallel)
        return Mesh(grid, (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    grid = np.asarray(devices[:n], dtype=object).reshape(data_parallel, expert_parallel, tensor_parallel)
    return Mesh(grid, (DATA, EXPERT, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 3)


def mesh_shape(mesh: Mesh | None) -> dict[str, int]:
    """{"data": M, "model": N}, plus "expert" on a mesh that has the axis (what the --json stats report);
    1 x 1 without a mesh."""
    if mesh is None:
        return {DATA: 1, MODEL: 1}
    return {name: int(mesh.shape[name]) for name in (DATA, EXPERT, MODEL) if name in mesh.shape}


def check_fits(cfg, tensor_parallel: int, expert_parallel: int = 1) -> None:
    """Raises ConfigError naming the dimension when the model cannot be split tensor_parallel ways (and its
    experts expert_parallel ways)."""
    tp, ep = tensor_parallel, expert_parallel
    if ep > 1 and (not cfg.num_experts or cfg.num_experts % ep):
        raise ConfigError(f"expert_parallel {ep} needs a MoE target whose num_experts it divides; this model has "
                          f"{cfg.num_experts or 'no'} experts")
    if tp == 1:
        return
    mlp = (("expert_size (each expert's MLP width)", cfg.expert_size) if cfg.num_experts
           else ("intermediate_size (MLP width)", cfg.intermediate_size))
    for name, size in (("num_heads (attention heads)", cfg.num_heads), mlp):
        if size % tp:
            raise ConfigError(f"tensor_parallel {tp} does not divide the model's {name} = {size}; "
                              f"pick a degree that divides it")
    k = cfg.num_kv_heads
    if k % tp and tp % k:
        raise ConfigError(f"tensor_parallel {tp} and the model's num_kv_heads = {k}: one must divide the other "
                          f"(kv heads are split when they divide the degree, else replicated)")


def kv_split(num_kv_heads: int, tensor_parallel: int) -> bool:
    """Whether kv heads are split over "model" (else every model shard holds all of them)."""
    return num_kv_heads % tensor_parallel == 0


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], cfg, tp: int, ep: int = 1) -> P:
    """The PartitionSpec of one target parameter (flat NNX path, e.g. ("layers", "3", "wq"))."""
    name = path[-1]
    if cfg.num_experts and name in ("w_gate", "w_up", "w_down"):  # [E, H, F] / [E, F, H]
        expert, width = EXPERT if ep > 1 else None, MODEL if tp > 1 else None
        return P(expert, None, width) if name != "w_down" else P(expert, width, None)
    kv = MODEL if kv_split(cfg.num_kv_heads, tp) else None
    vocab = MODEL if cfg.vocab_size % tp == 0 else None
    columns = {"wq": MODEL, "bq": MODEL, "wk": kv, "bk": kv, "wv": kv, "bv": kv, "w_gate": MODEL, "w_up": MODEL,
               "lm_head": vocab}
    rows = {"wo": MODEL, "w_down": MODEL, "embed": vocab}
    if name in columns and columns[name] is not None:
        return P(*([None] * (len(shape) - 1)), columns[name])  # biases are 1-D: their only axis
    if name in rows and rows[name] is not None:
        return P(rows[name], *([None] * (len(shape) - 1)))
    return P()


def shard_params(state, cfg, mesh: Mesh):
    """The target's NNX state with every parameter placed on the mesh by `param_spec`."""
    from flax import nnx

    tp, ep = mesh.shape[MODEL], mesh.shape.get(EXPERT, 1)
    flat = []
    for path, var in nnx.to_flat_state(state):
        key = tuple(str(k) for k in path)
        value = var[...]
        spec = param_spec(key, value.shape, cfg, tp, ep)
        flat.append((path, var.replace(jax.device_put(value, NamedSharding(mesh, spec)))))
    return nnx.from_flat_state(flat)


def place_experts(state, cfg, mesh: Mesh):
    """A target's NNX state on a mesh with an "expert" axis (the trainer's): each MoE layer's experts
    split over it, every other parameter replicated (the frozen target's forward in training)."""
    from flax import nnx

    flat = []
    for path, var in nnx.to_flat_state(state):
        name = str(path[-1])
        split = cfg.num_experts and name in ("w_gate", "w_up", "w_down") and EXPERT in mesh.shape
        spec = P(EXPERT, None, None) if split else P()
        flat.append((path, var.replace(jax.device_put(var[...], NamedSharding(mesh, spec)))))
    return nnx.from_flat_state(flat)


def replicate(tree, mesh: Mesh):
    """Every array of tree (e.g. a draft head's state) replicated on the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def state_shardings(tree, mesh: Mesh, num_kv_heads: int):
    """NamedShardings for a pytree of DecodeStates, KVCaches and per-row arrays. A target's KV cache (a
    DecodeState's `cache`, or a bare KVCache) is split by kv head over "model" when num_kv_heads divides
    the degree (None: heads replicated, as for the draft's `draft_cache`), its rows over "data" (paged
    pools are shared by every row: not split by rows); every other array's first axis (the batch) over
    "data", scalars replicated. Works on arrays and on jax.ShapeDtypeStructs."""
    tp = mesh.shape[MODEL]
    kv = MODEL if num_kv_heads and kv_split(num_kv_heads, tp) else None
    named = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731

    def rows(x):
        return named(DATA, *([None] * (len(x.shape) - 1))) if len(x.shape) else named()

    def cache(c: KVCache, heads):
        pool = (lambda x: named(None, None, heads, None)) if c.paged else (lambda x: named(DATA, None, heads, None))
        return KVCache(tuple(pool(x) for x in c.k), tuple(pool(x) for x in c.v), rows(c.lengths),
                       None if c.table is None else rows(c.table))

    def one(x):
        if hasattr(x, "draft_cache"):  # a DecodeState: the draft's cache is replicated over "model"
            rest = {f: jax.tree_util.tree_map(rows, getattr(x, f))
                    for f in ("root", "root_hidden", "lag_feats", "lag_tokens", "lag_n")}
            return x.replace(cache=cache(x.cache, kv), draft_cache=cache(x.draft_cache, None), **rest)
        if isinstance(x, KVCache):
            return cache(x, kv)
        return rows(x)

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, KVCache) or hasattr(x, "draft_cache"))


def place(tree, mesh: Mesh | None, num_kv_heads: int):
    """tree (a DecodeState, KVCache, SamplingParams or per-row arrays) on the mesh (`state_shardings`);
    unchanged without a mesh."""
    if mesh is None or tree is None:
        return tree
    return jax.device_put(tree, state_shardings(tree, mesh, num_kv_heads))


def constrain(tree, mesh: Mesh | None, num_kv_heads: int):
    """Inside jit: tree's arrays constrained to `state_shardings` (outputs keep one layout, step after step)."""
    if mesh is None or tree is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, state_shardings(tree, mesh, num_kv_heads))


def replicated(tree, mesh: Mesh | None):
    """Inside jit: tree replicated (what the host reads every step: emitted tokens and counts)."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, P()))


def abstract(tree, mesh: Mesh | None, num_kv_heads: int):
    """jax.ShapeDtypeStructs of tree's arrays, with their `state_shardings` on a mesh (what ahead-of-time
    compiles are lowered for)."""
    def shape_of(a):
        if isinstance(a, jax.ShapeDtypeStruct):
            return a
        return jax.ShapeDtypeStruct(np.shape(a), a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype)

    shapes = jax.tree_util.tree_map(shape_of, tree)
    if mesh is None:
        return shapes
    return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                                  state_shardings(shapes, mesh, num_kv_heads))


def distributed_requested() -> bool:
    """Whether the environment names a coordinator (the variables `initialize` reads)."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None):
    """Joins this process to the others (`jax.distributed.initialize`); arguments default to the
    environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), or to what the platform
    provides on TPU pods and SLURM / Open MPI clusters. CPU processes exchange collectives through gloo."""
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # a JAX without the option picks its own
        pass
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def shard_target(target, tensor_parallel: int = 1, data_parallel: int = 1, devices=None, expert_parallel: int = 1):
    """Places target's parameters on a data_parallel x [expert_parallel x] tensor_parallel mesh
    (`param_spec`; one device: back on one device) and returns it; engines made for its earlier layout are
    dropped (the next `generate` compiles for the new one). ConfigError names the dimension or the device
    count that does not fit."""
    from flax import nnx

    check_fits(target.cfg, tensor_parallel, expert_parallel)
    if data_parallel > 1 and jax.process_count() > 1:
        raise ConfigError("data_parallel > 1 with several processes is not supported: rows would sit on other "
                          "processes' devices, and every process reads every row's tokens; split the model across "
                          "processes (tensor_parallel) instead")
    mesh = make_mesh(tensor_parallel, data_parallel, devices, expert_parallel)
    model = target.model
    if mesh == model.mesh:  # (None == None: already on one device)
        return target
    state = nnx.state(model)
    if mesh is None:
        state = jax.device_put(state, jax.devices()[0])
    else:
        state = shard_params(state, target.cfg, mesh)
    nnx.update(model, state)
    model.mesh = mesh
    target.engines.clear()
    return target


def add_mesh_args(parser) -> None:
    """--tensor-parallel, --data-parallel and --distributed on a CLI (generate, bench, serve)."""
    g = parser.add_argument_group("parallelism (a target sharded over a device mesh)")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the target over N devices: attention heads, MLP width, vocabulary and KV cache "
                        "(default: %(default)s)")
    g.add_argument("--data-parallel", type=int, default=1, metavar="M",
                   help="split batch rows over M groups of --tensor-parallel devices (default: %(default)s)")
    g.add_argument("--expert-parallel", type=int, default=1, metavar="E",
                   help="MoE targets: split each layer's experts over E groups of --tensor-parallel devices "
                        "(default: %(default)s)")
    g.add_argument("--distributed", action="store_true",
                   help="join the other processes with jax.distributed.initialize() first (multi-host TPU / GPU, "
                        "or CPU processes through gloo); the coordinator comes from JAX_COORDINATOR_ADDRESS, "
                        "JAX_NUM_PROCESSES and JAX_PROCESS_ID, or from the platform (TPU pods, SLURM)")


def setup_from_args(args) -> None:
    """Joins the processes when the CLI asked for it (--distributed, or a coordinator in the environment),
    before anything else touches JAX's devices."""
    if getattr(args, "distributed", False) or distributed_requested():
        initialize()


def is_leader() -> bool:
    """Whether this process prints and serves (process 0 of a multi-process run; always on one process)."""
    return jax.process_index() == 0
