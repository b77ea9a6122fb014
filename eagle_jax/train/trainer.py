"""The draft-head trainer: optax AdamW (warmup + cosine, global-norm clipping, optional accumulation),
a device mesh with a data axis, orbax checkpoints that resume exactly, and export to the official layout.

Only the head's `nnx.Param`s are optimised; the target is frozen and passed to the step as a
separate argument, so it is never copied into optimizer state. A checkpoint holds the head params,
the optimizer state, the step, the RNG key and the data position (next row to read), so a resumed
run reads the same batches and draws the same noise as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle_jax.compiling import jit_pair, param_count, quick
from eagle_jax.draft import DraftHead, save_draft
from eagle_jax.quant import dequantize
from eagle_jax.sharding import check_fits, place_experts
from eagle_jax.train import losses
from eagle_jax.train.features import Batch, FeatureExtractor, token_batches


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    steps: int = 1000
    lr: float = 1e-4
    warmup_steps: int = 50
    decay_steps: int = 0  # length of the warmup + cosine schedule; 0: `steps`. Set it to stop a run early
    # (steps < decay_steps) on the same schedule, and to extend it later by raising `steps` and resuming.
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    grad_accum: int = 1
    batch_size: int = 8
    seq_len: int = 256
    seq_bucket: int = 0  # > 0: batches trimmed to their longest row rounded up to this (see token_batches)
    group_by_length: bool = False  # rows sorted into similar-length batches, batch order shuffled
    ttt_length: int = 7
    reg_weight: float = 1.0  # EAGLE-1 feature regression
    cls_weight: float = 0.1  # EAGLE-1 classification
    noise_std: float = 0.0  # EAGLE-1 input-feature noise
    seed: int = 0
    compute_dtype: str = "auto"  # "auto": bfloat16 on TPU/GPU, float32 on CPU; params stay float32
    fsdp: int = 1  # devices per parameter shard (mesh axis "fsdp"); the rest form the "data" axis
    expert: int = 1  # MoE targets: devices the frozen target's experts are split over (mesh axis "expert")
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    eval_every: int = 100
    log_every: int = 10


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=max(cfg.warmup_steps, 1),
        decay_steps=max(cfg.decay_steps or cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
    return optax.MultiSteps(opt, every_k_schedule=cfg.grad_accum) if cfg.grad_accum > 1 else opt


def data_mesh(devices=None, fsdp: int = 1, expert: int = 1) -> jax.sharding.Mesh:
    """A (data, fsdp) mesh over the devices: batches split over both axes, params over 'fsdp'. expert > 1
    adds an "expert" axis that splits a MoE target's experts (batches are replicated over it)."""
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) % (fsdp * expert):
        raise ValueError(f"fsdp={fsdp} x expert={expert} does not divide the {len(devices)} devices")
    if expert == 1:
        return jax.sharding.Mesh(np.asarray(devices).reshape(len(devices) // fsdp, fsdp), ("data", "fsdp"))
    grid = np.asarray(devices).reshape(len(devices) // (fsdp * expert), fsdp, expert)
    return jax.sharding.Mesh(grid, ("data", "fsdp", "expert"))


def param_sharding(mesh, x) -> NamedSharding:
    """Shards a parameter's largest dimension divisible by the fsdp axis; small ones are replicated."""
    n = mesh.shape["fsdp"]
    if n > 1 and x.ndim >= 2:
        dims = sorted(range(x.ndim), key=lambda d: -x.shape[d])
        for d in dims:
            if x.shape[d] % n == 0:
                spec = [None] * x.ndim
                spec[d] = "fsdp"
                return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())


def compute_dtype(cfg: OptimConfig):
    if cfg.compute_dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(cfg.compute_dtype)


def _loss(params, rest, graphdef, target, batch: dict, key, cfg: OptimConfig):
    # Master params stay float32; the forward runs in the compute dtype (gradients flow back through the cast).
    dt = compute_dtype(cfg)
    params = jax.tree_util.tree_map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    head = nnx.merge(graphdef, params, rest)
    mask = batch["mask"]
    if head.cfg.kind == "eagle3":
        return losses.eagle3_loss(head, target, batch["tokens"], batch["hidden"], batch["aux"], mask,
                                  ttt_length=cfg.ttt_length)
    noise = None
    if cfg.noise_std > 0:
        noise = cfg.noise_std * jax.random.normal(key, batch["hidden"][:, :-1].shape, batch["hidden"].dtype)
    return losses.eagle1_loss(head, target, batch["tokens"], batch["hidden"], mask, noise,
                              cfg.reg_weight, cfg.cls_weight)


# Training steps whose (head + target parameters) x batch tokens are under this compile without LLVM
# optimisation (`eagle_jax.compiling`). Measured on XLA:CPU, 4-layer tiny target + EAGLE-3 head (130k
# parameters), 8 x 32 tokens, 200 steps: 16.8 s optimised (12.4 s of it compiling) vs 13.2 s (6.6 s),
# the same accuracies; the quick program's extra 11 ms a step costs as much after about 500 steps.
QUICK_TRAIN_WORK = 1 << 26


class Trainer:
    def __init__(self, target, head: DraftHead, cfg: OptimConfig, mesh=None):
        self.target, self.cfg = target, cfg
        self.mesh = mesh or data_mesh(fsdp=cfg.fsdp, expert=cfg.expert)
        self.graphdef, params, self.rest = nnx.split(head, nnx.Param, ...)
        self.batch_sharding = NamedSharding(self.mesh, P(("data", "fsdp")))
        # float32 master copies (the step donates its params, and the caller's head must stay usable).
        params = jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32), params)
        self.params = jax.tree_util.tree_map(lambda x: jax.device_put(x, param_sharding(self.mesh, x)), params)
        self.tx = make_optimizer(cfg)
        self.opt_state = jax.jit(self.tx.init)(self.params)  # follows the params' shardings
        self.target_graphdef, self.target_state = nnx.split(target.model)
        experts = "expert" in self.mesh.shape
        if experts:  # the frozen target's experts split over the "expert" axis, for its forward here
            check_fits(target.cfg, 1, self.mesh.shape["expert"])
            self.target_state = place_experts(self.target_state, target.cfg, self.mesh)
        self.extractor = FeatureExtractor(target, head.cfg.aux_layers if head.cfg.kind == "eagle3" else (),
                                          state=self.target_state if experts else None,
                                          batch_sharding=self.batch_sharding if experts else None)
        self.step = 0
        self.data_pos = 0
        self.key = jax.random.PRNGKey(cfg.seed)
        fast = quick(param_count(self.params, self.target_state) * cfg.batch_size * cfg.seq_len, QUICK_TRAIN_WORK)
        self._train_step = jit_pair(self._step_fn, donate_argnums=(0, 1))[fast]
        self._eval_step = jit_pair(self._eval_fn)[fast]

    # --- jitted pieces -----------------------------------------------------------------------------
    def _step_fn(self, params, opt_state, target_state, batch, key):
        target = nnx.merge(self.target_graphdef, target_state)
        grad_fn = jax.value_and_grad(_loss, has_aux=True)
        (loss, metrics), grads = grad_fn(params, self.rest, self.graphdef, target, batch, key, self.cfg)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        return params, opt_state, metrics

    def _eval_fn(self, params, target_state, batch):
        target = nnx.merge(self.target_graphdef, target_state)
        _, metrics = _loss(params, self.rest, self.graphdef, target, batch, jax.random.PRNGKey(0),
                           dataclasses.replace(self.cfg, noise_std=0.0))
        return metrics

    # --- host side ---------------------------------------------------------------------------------
    def device_batch(self, b: Batch) -> dict:
        if b.hidden is None:
            b = self.extractor(b)
        arrays = {"tokens": b.tokens, "hidden": b.hidden,
                  "mask": (b.loss_mask.astype(bool) & b.valid).astype(np.float32)}
        if b.aux is not None:
            arrays["aux"] = b.aux
        return jax.device_put(arrays, self.batch_sharding)

    def head(self) -> DraftHead:
        return nnx.merge(self.graphdef, jax.device_get(self.params), self.rest)

    def batches(self, rows, features_dir=None):
        """(next data position, batch) from data_pos on: online (tokens only) or offline features."""
        bs = self.cfg.batch_size
        if features_dir is None:
            yield from token_batches(rows, bs, self.cfg.seq_len, start=self.data_pos,
                                     seq_bucket=self.cfg.seq_bucket)
            return
        from eagle_jax.train.features import cached_feature_batches

        first = self.data_pos // bs
        for i, b in enumerate(cached_feature_batches(self.extractor, rows, bs, self.cfg.seq_len, features_dir,
                                                     self.cfg.seq_bucket, first)):
            yield min((first + i + 1) * bs, len(rows)), b

    def train(self, rows, steps: int | None = None, eval_rows=None, checkpointer=None,
              on_log: Callable[[dict], None] | None = None, stop_after: int | None = None,
              features_dir=None, deadline: float | None = None) -> list[dict]:
        """Runs until `steps` (default cfg.steps); cycles over `rows` in order, resuming at data_pos.
        deadline (a `time.monotonic()` value): the first step that ends after it is the run's last, logged,
        evaluated and checkpointed as the final step is (a time-boxed run; rerun to continue).

        With features_dir the target's features of each batch are computed once, written there and
        read back in later epochs (`features.cached_feature_batches`).
        """
        cfg = self.cfg
        steps = steps or cfg.steps
        history = []
        # Trained tokens/s over each log interval: from the end of the first step (which compiles) and
        # not counting the evaluation and checkpoint of the previous log.
        mark, tokens_seen, tokens_mark = None, 0, 0
        while self.step < steps:
            for next_pos, batch in self.batches(rows, features_dir):
                self.key, sub = jax.random.split(self.key)
                dev = self.device_batch(batch)
                self.params, self.opt_state, metrics = self._train_step(
                    self.params, self.opt_state, self.target_state, dev, sub)
                self.step += 1
                self.data_pos = next_pos if next_pos < len(rows) else 0
                tokens_seen += int(batch.valid.sum())
                if mark is None:
                    jax.block_until_ready(metrics)
                    mark, tokens_mark = time.perf_counter(), tokens_seen
                last = self.step == steps or (deadline is not None and time.monotonic() >= deadline)
                logged = self.step % cfg.log_every == 0 or last
                if logged:
                    m = jax.device_get(metrics)
                    now = time.perf_counter()
                    rec = {"step": self.step, "loss": float(m["loss"]), "acc": np.asarray(m["acc"]).tolist(),
                           "grad_norm": float(m["grad_norm"]),
                           "tokens_per_s": (tokens_seen - tokens_mark) / (now - mark) if tokens_seen > tokens_mark
                           else None}
                    if eval_rows is not None and (self.step % cfg.eval_every == 0 or last):
                        rec["eval_acc"] = self.evaluate(eval_rows)
                    history.append(rec)
                    if on_log:
                        on_log(rec)
                if checkpointer is not None and (self.step % cfg.checkpoint_every == 0 or last):
                    checkpointer.save(self)
                if logged:
                    mark, tokens_mark = time.perf_counter(), tokens_seen
                if last or self.step >= steps or (stop_after is not None and self.step >= stop_after):
                    return history
                if self.data_pos == 0:
                    break  # epoch boundary: restart the iterator from row 0
        return history

    def evaluate(self, rows) -> list[float]:
        """Per-TTT-step top-1 acceptance accuracy on held-out rows (one entry for EAGLE-1)."""
        accs, weights = [], []
        for _, batch in token_batches(rows, self.cfg.batch_size, self.cfg.seq_len, seq_bucket=self.cfg.seq_bucket):
            dev = self.device_batch(batch)
            m = jax.device_get(self._eval_step(self.params, self.target_state, dev))
            accs.append(np.atleast_1d(np.asarray(m["acc"])))
            weights.append(float(dev["mask"].sum()))
        w = np.asarray(weights) / max(sum(weights), 1.0)
        return (np.stack(accs) * w[:, None]).sum(0).tolist()


class Checkpointer:
    """orbax CheckpointManager (async, keep-N) over params, optimizer state, RNG, step and data position."""

    def __init__(self, directory, keep: int = 3):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True))

    def _tree(self, tr: Trainer):
        return {"params": tr.params, "opt_state": tr.opt_state, "key": jax.random.key_data(tr.key)
                if jnp.issubdtype(tr.key.dtype, jax.dtypes.prng_key) else tr.key}

    def save(self, tr: Trainer):
        args = self.ocp.args.Composite(
            state=self.ocp.args.StandardSave(self._tree(tr)),
            meta=self.ocp.args.JsonSave({"step": tr.step, "data_pos": tr.data_pos}))
        self.manager.save(tr.step, args=args)

    def restore_latest(self, tr: Trainer) -> bool:
        step = self.manager.latest_step()
        if step is None:
            return False
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                          if hasattr(x, "sharding") else x, self._tree(tr))
        out = self.manager.restore(step, args=self.ocp.args.Composite(
            state=self.ocp.args.StandardRestore(abstract), meta=self.ocp.args.JsonRestore()))
        tr.params, tr.opt_state, tr.key = out["state"]["params"], out["state"]["opt_state"], out["state"]["key"]
        tr.step, tr.data_pos = int(out["meta"]["step"]), int(out["meta"]["data_pos"])
        return True

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.close()


def export(trainer: Trainer, path, dtype="float32") -> Path:
    return save_draft(trainer.head(), path, dtype=dtype)


def init_head(target, kind: str = "eagle3", draft_vocab_size: int | None = None, train_rows=(), *,
              init_from=None, init_from_target_layer: bool = False, seed: int = 0) -> DraftHead:
    """A draft head to train for `target`.

    * init_from: continue from an exported head directory (its weights and draft vocabulary); its kind
      and draft vocabulary size must match (ValueError naming both otherwise).
    * else a fresh head (seed); for EAGLE-3 the draft vocabulary is the most frequent answer tokens of
      `train_rows` (plus EOS), and with init_from_target_layer its decoder layer's output projection,
      MLP and norm copy the target's top layer, its lm_head the target's rows for the draft vocabulary
      and its final norm the target's (a head that starts close to the target's last layer).
    """
    from eagle_jax.draft import DraftConfig, load_draft
    from eagle_jax.train.features import build_draft_vocab

    cfg = DraftConfig.for_target(target.cfg, kind, draft_vocab_size)
    if init_from is not None:
        head = load_draft(init_from, target.cfg, dtype=target.model.dtype)
        if (head.cfg.kind, head.cfg.draft_vocab_size, head.cfg.aux_layers) != (kind, cfg.draft_vocab_size,
                                                                                cfg.aux_layers):
            raise ValueError(f"{init_from} is a {head.cfg.kind} head with draft vocabulary "
                             f"{head.cfg.draft_vocab_size}; asked for {kind} / {cfg.draft_vocab_size}")
        return head
    head = DraftHead(cfg, rngs=nnx.Rngs(seed), dtype=target.model.dtype)
    if kind == "eagle3":
        d2t, _ = build_draft_vocab(train_rows, cfg.vocab_size, cfg.draft_vocab_size, always=target.eos_token_ids)
        head.d2t[...] = np.asarray(d2t, np.int32)
    if init_from_target_layer:
        top = target.model.layers[target.cfg.num_layers - 1]
        if target.cfg.num_experts:
            raise ValueError("init_from_target_layer copies the target's MLP: a MoE target's experts do not fit "
                             "the head's dense MLP")
        for name in ("wo", "w_gate", "w_up", "w_down"):  # (a quantized target's matrices, dequantized)
            getattr(head, name)[...] = dequantize(getattr(top, name)[...], head.fc[...].dtype)
        head.post_norm[...] = top.mlp_norm[...]
        if kind == "eagle3":
            keep = np.arange(cfg.draft_vocab_size) + np.asarray(head.d2t[...])
            head.lm_head[...] = np.asarray(dequantize(target.model.lm_head_weight()))[:, keep]
            head.norm[...] = target.model.final_norm[...]
    return head
