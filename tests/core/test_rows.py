"""Row surgery between batch buckets (`rows.take_rows`): the moved rows, the emptied ones, and the
consuming move that frees the old state array by array."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import steps
from eagle_jax.rows import compile_take_rows, take_rows
from builders import oracle_pair


def _filled_state(batch: int = 2):
    tgt, head = oracle_pair()
    s = steps.empty_state(tgt, head, batch, 32, 40)
    rng = np.random.default_rng(0)
    # Distinct values in every array (fresh arrays, none shared), lengths 5, 9 (and 7).
    s = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.integers(1, 100, a.shape).astype(a.dtype)), s)
    lengths = jnp.asarray([5, 9, 7][:batch], jnp.int32)
    return s.replace(cache=s.cache.replace(lengths=lengths), draft_cache=s.draft_cache.replace(lengths=lengths),
                     lag_n=jnp.asarray([1, 2, 0][:batch], jnp.int32))


@pytest.mark.parametrize("host", [None, False], ids=["numpy", "compiled"])
@pytest.mark.parametrize("consume", [False, True])
def test_take_rows_moves_rows_and_empties_the_rest(consume, host):
    s = _filled_state()
    before = jax.tree_util.tree_map(np.asarray, s)
    out = take_rows(s, np.asarray([1, -1, 0, -1], np.int32), consume=consume, host=host)
    assert out.root.shape == (4,) and out.cache.k[0].shape[0] == 4
    np.testing.assert_array_equal(out.cache.lengths, [9, 0, 5, 0])
    np.testing.assert_array_equal(out.draft_cache.lengths, [9, 0, 5, 0])
    np.testing.assert_array_equal(out.lag_n, [2, 0, 1, 0])
    for new, old in zip(jax.tree_util.tree_leaves(out.cache.k), jax.tree_util.tree_leaves(before.cache.k)):
        np.testing.assert_array_equal(np.asarray(new)[[0, 2]], old[[1, 0]])
    np.testing.assert_array_equal(np.asarray(out.root_hidden)[[0, 2]], before.root_hidden[[1, 0]])
    deleted = [a.is_deleted() for a in jax.tree_util.tree_leaves(s)]
    assert all(deleted) if consume else not any(deleted)


def test_a_consuming_move_copies_an_array_held_twice_once():
    s = _filled_state()
    shared = s.cache.lengths
    s = s.replace(draft_cache=s.draft_cache.replace(lengths=shared))  # the same array in two fields
    out = take_rows(s, np.asarray([1, 0], np.int32), consume=True)
    np.testing.assert_array_equal(out.cache.lengths, [9, 5])
    np.testing.assert_array_equal(out.draft_cache.lengths, [9, 5])
    assert shared.is_deleted()


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def test_compiled_ahead_the_move_traces_and_compiles_nothing_new():
    """What a server's preparation does before a compiled bucket move (`compile_take_rows`, as on an
    accelerator) is all the move needs; without it the same move traces and compiles; on CPU (numpy)
    the move compiles nothing at all. Row counts no other test uses (11, 13, 15), so nothing earlier in
    this process has compiled them."""
    compiles = []
    listening = [True]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if listening[0] and event == BACKEND_COMPILE else None)
    try:
        s = _filled_state(3)
        compile_take_rows(jax.eval_shape(lambda: s), 11, host=False)
        before, compiles[:] = steps.TRACE_COUNTS["take_rows"], []
        out = take_rows(s, np.asarray([2, 0, 1] + [-1] * 8, np.int32), consume=True, host=False)
        assert (steps.TRACE_COUNTS["take_rows"] - before, len(compiles)) == (0, 0)
        np.testing.assert_array_equal(out.cache.lengths, [7, 5, 9] + [0] * 8)
        # The control: 13 rows, not compiled ahead.
        before, compiles[:] = steps.TRACE_COUNTS["take_rows"], []
        take_rows(_filled_state(3), np.asarray([0, 1, 2] + [-1] * 10, np.int32), consume=True, host=False)
        assert steps.TRACE_COUNTS["take_rows"] > before and compiles
        s = _filled_state(3)  # on CPU: numpy, with nothing compiled ahead
        before, compiles[:] = steps.TRACE_COUNTS["take_rows"], []
        out = take_rows(s, np.asarray([1, 2, 0] + [-1] * 12, np.int32), consume=True, cache_len=16)
        assert (steps.TRACE_COUNTS["take_rows"] - before, len(compiles)) == (0, 0)
        np.testing.assert_array_equal(out.cache.lengths, [9, 7, 5] + [0] * 12)
    finally:
        listening[0] = False


@pytest.mark.parametrize("host", [None, False], ids=["numpy", "compiled"])
def test_a_move_cuts_or_pads_the_caches_to_the_new_length(host):
    """cache_len / draft_len: the caches of the moved rows keep their first slots, cut to a shorter
    length or zero-padded to a longer one; nothing else changes."""
    s = _filled_state()  # caches of 32 (target) and 40 (draft) slots
    before = jax.tree_util.tree_map(np.asarray, s)
    short = take_rows(s, np.asarray([1, 0], np.int32), cache_len=16, draft_len=24, host=host)
    assert short.cache.k[0].shape[1] == 16 and short.draft_cache.k[0].shape[1] == 24
    np.testing.assert_array_equal(np.asarray(short.cache.v[0]), before.cache.v[0][[1, 0], :16])
    np.testing.assert_array_equal(np.asarray(short.draft_cache.k[0]), before.draft_cache.k[0][[1, 0], :24])
    np.testing.assert_array_equal(np.asarray(short.lag_feats), before.lag_feats[[1, 0]])
    long = take_rows(short, np.asarray([0, 1, -1, -1], np.int32), cache_len=48, draft_len=56, host=host)
    k = np.asarray(long.cache.k[0])
    assert k.shape[:2] == (4, 48) and long.draft_cache.v[0].shape[1] == 56
    np.testing.assert_array_equal(k[:2, :16], before.cache.k[0][[1, 0], :16])
    assert not k[:, 16:].any()
    np.testing.assert_array_equal(long.cache.lengths, [9, 5, 0, 0])
