"""Paged KV cache: the block pool, the paged cache functions against the contiguous ones, and decoding on
paged caches against plain decoding on contiguous ones (greedy token for token, sampled rows alike)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle_jax
from eagle_jax import engine, steps
from eagle_jax.kv_cache import KVCache, gather_rows, read_rows, write_rows
from eagle_jax.paging import NO_BLOCK, BlockPool, OutOfBlocks, block_table, blocks_for
from eagle_jax.sampling import SamplingParams
from eagle_jax.tree import TreeConfig
from builders import MORE_PROMPTS, oracle_pair


@pytest.fixture(scope="module")
def oracle():
    return oracle_pair()


@pytest.fixture(scope="module")
def plain40(oracle):
    """Plain decoding of MORE_PROMPTS on the contiguous cache, 40 tokens each."""
    return eagle_jax.generate(oracle[0], MORE_PROMPTS, max_new_tokens=40)


def test_block_pool_hands_out_each_block_once_and_refuses_what_it_does_not_have():
    pool = BlockPool(6, 4)
    assert blocks_for(0, 4) == 0 and blocks_for(1, 4) == 1 and blocks_for(8, 4) == 2 and blocks_for(9, 4) == 3
    a = pool.take(4)
    assert sorted(a) == [0, 1, 2, 3] and pool.free == 2 and pool.used == 4
    with pytest.raises(OutOfBlocks, match="3 blocks wanted, 2 of 6 free"):
        pool.take(3)
    assert pool.free == 2  # a refused request takes nothing
    b = pool.take(2)
    assert not set(a) & set(b)
    pool.release(a[1:3])
    assert pool.take(2) == [a[2], a[1]]  # freed last, handed out first
    with pytest.raises(ValueError, match="not held"):
        pool.release([a[1], a[1]])
    pool.release(b)
    with pytest.raises(ValueError, match=r"not held \(or twice\): \[%d\]" % b[0]):
        pool.release([b[0]])
    table = block_table([[5, 2], [], [1]], 3)
    np.testing.assert_array_equal(table, [[5, 2, NO_BLOCK], [NO_BLOCK] * 3, [1, NO_BLOCK, NO_BLOCK]])
    with pytest.raises(ValueError, match="row 0 holds 4 blocks; the table has room for 3"):
        block_table([[0, 1, 2, 3]], 3)


def _scattered(rng, num_blocks, per_row, width):
    """A table whose rows hold per_row[i] blocks picked at random from the pool (no block twice)."""
    order = rng.permutation(num_blocks)
    rows, at = [], 0
    for n in per_row:
        rows.append(order[at: at + n].tolist())
        at += n
    return block_table(rows, width)


def _to_pool(contig, table, num_blocks, block_size, fill=np.nan):
    """The pool holding contig [B, S, K, D]'s slots where table puts them; blocks no row holds: fill."""
    b, s = contig.shape[:2]
    pool = np.full((num_blocks, block_size) + contig.shape[2:], fill, np.float32)
    for r in range(b):
        for j, blk in enumerate(table[r]):
            if blk >= 0:
                pool[blk] = contig[r, j * block_size: (j + 1) * block_size]
    return pool


def test_paged_writes_reads_and_path_moves_match_the_contiguous_cache_and_stay_in_the_row():
    rng = np.random.default_rng(0)
    b, s, kv, d, bs, nblocks = 3, 32, 2, 4, 4, 20
    table = _scattered(rng, nblocks, [8, 3, 5], s // bs)  # row 1 holds slots [0, 12), row 2 [0, 20)
    contig = rng.normal(size=(b, s, kv, d)).astype(np.float32)
    for r, held in enumerate([32, 12, 20]):
        contig[r, held:] = 0  # what a paged row reads where it holds no block
    pool = _to_pool(contig, table, nblocks, bs)
    t_j = jnp.asarray(table)

    np.testing.assert_array_equal(np.asarray(read_rows(jnp.asarray(pool), t_j)), contig)
    np.testing.assert_array_equal(np.asarray(read_rows(jnp.asarray(pool), t_j, window=12)), contig[:, :12])

    new = rng.normal(size=(b, 5, kv, d)).astype(np.float32)
    starts = jnp.asarray([3, 9, 17], jnp.int32)  # row 1 writes slots 9..13: 12 and 13 have no block
    want = np.array(write_rows(jnp.asarray(contig), jnp.asarray(new), starts))
    want[1, 12:] = 0
    want[2, 20:] = 0
    got_pool = np.asarray(write_rows(jnp.asarray(pool), jnp.asarray(new), starts, t_j))
    np.testing.assert_array_equal(np.asarray(read_rows(jnp.asarray(got_pool), t_j)), want)
    free = sorted(set(range(nblocks)) - set(table[table >= 0].tolist()))
    assert np.isnan(got_pool[free]).all()  # nobody's blocks were touched

    lengths = jnp.asarray([3, 9, 17], jnp.int32)
    src, counts = jnp.asarray([[0, 2, 4], [0, 1, 3], [0, 3, 2]], jnp.int32), jnp.asarray([3, 2, 1], jnp.int32)
    ref = gather_rows(KVCache((jnp.asarray(want),), (jnp.asarray(want),), lengths), src, counts)
    paged = gather_rows(KVCache((jnp.asarray(got_pool),), (jnp.asarray(got_pool),), lengths, t_j), src, counts)
    np.testing.assert_array_equal(np.asarray(paged.lengths), np.asarray(ref.lengths))
    want_moved = np.array(ref.k[0])
    want_moved[1, 12:] = 0
    want_moved[2, 20:] = 0
    np.testing.assert_array_equal(np.asarray(read_rows(paged.k[0], paged.table)), want_moved)
    assert np.isnan(np.asarray(paged.v[0])[free]).all()


@pytest.mark.parametrize("trees", [[None], [TreeConfig(4, 4, 16), None, TreeConfig.chain(2)]], ids=["plain", "mixed"])
def test_steps_on_scattered_blocks_with_poisoned_free_blocks_equal_the_contiguous_cache(oracle, trees):
    """Rows of very different lengths on blocks scattered over a pool whose other blocks hold NaN: every
    step emits what the same step emits on contiguous caches, so no row reads or writes another's blocks."""
    tgt, head = oracle
    eng = engine.Engine(tgt, head)
    prompts = [MORE_PROMPTS[1], MORE_PROMPTS[2], MORE_PROMPTS[6]]  # 19, 1 and 17 tokens
    b, s_len, bs, n_steps = 4, 64, 8, 10
    d_len = s_len + steps.draft_extra([t for t in trees if t is not None])
    width = blocks_for(d_len, bs)
    rng = np.random.default_rng(1)
    need = [min(len(p) + 5 * n_steps + steps.draft_extra([TreeConfig(4, 4, 16)]), width * bs) for p in prompts]
    nblocks = sum(blocks_for(n, bs) for n in need) + 7
    table = _scattered(rng, nblocks, [blocks_for(n, bs) for n in need] + [0], width)
    tokens = np.zeros((b, 24), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts] + [1], jnp.int32)
    params = SamplingParams.make(b)
    active = jnp.asarray([True, True, True, False])
    parts = (eng.graphdef, eng.state, eng.head_graphdef, eng.head_state)
    free = np.asarray(sorted(set(range(nblocks)) - set(table[table >= 0].tolist())))

    def run(paged: bool):
        empty = steps.empty_state(tgt, head, b, s_len, d_len, pages=(nblocks, bs, table) if paged else None)
        if paged:  # the blocks no row holds are NaN: a row reading one would emit garbage
            poison = lambda c: c.replace(k=tuple(a.at[free].set(jnp.nan) for a in c.k),  # noqa: E731
                                         v=tuple(a.at[free].set(jnp.nan) for a in c.v))
            empty = empty.replace(cache=poison(empty.cache), draft_cache=poison(empty.draft_cache))
        st = steps.prefill(*parts, jnp.asarray(tokens), lens, empty.cache, empty.draft_cache, params)
        out = [np.asarray(st.root).tolist()]
        for i in range(n_steps):
            st, emitted, count = steps.step(*parts, st, params, active, trees[i % len(trees)])
            out.append((np.asarray(emitted), np.asarray(count).tolist()))
        return out, st

    ref, ref_state = run(False)
    got, got_state = run(True)
    assert got[0] == ref[0]
    for (e_ref, c_ref), (e_got, c_got) in zip(ref[1:], got[1:]):
        assert c_got == c_ref
        for r in range(3):
            assert e_got[r, : c_ref[r]].tolist() == e_ref[r, : c_ref[r]].tolist()
    np.testing.assert_array_equal(np.asarray(got_state.cache.lengths)[:3], np.asarray(ref_state.cache.lengths)[:3])
    grown = int(np.asarray(got_state.cache.lengths)[0]) - len(prompts[0])
    assert grown > n_steps if trees != [None] else grown == n_steps  # trees were accepted
    assert np.isnan(np.asarray(got_state.cache.k[0])[free]).all()
    assert np.isnan(np.asarray(got_state.draft_cache.v[0])[free]).all()


@pytest.mark.parametrize("tree", [None, TreeConfig(4, 4, 16), "auto"], ids=str)
def test_generate_on_a_paged_cache_equals_plain_decoding(oracle, plain40, tree):
    tgt, head = oracle
    plain = plain40
    draft = None if tree is None else head
    paged = eagle_jax.generate(tgt, MORE_PROMPTS, draft=draft, tree=tree, max_new_tokens=40, block_size=8,
                               candidates=[TreeConfig(3, 2, 7)] if tree == "auto" else None)
    assert paged.token_ids == plain.token_ids


def test_sampled_rows_and_attention_windows_on_a_paged_cache_give_the_contiguous_cache_s_tokens(oracle):
    tgt, head = oracle
    kw = dict(draft=head, tree=TreeConfig(3, 2, 7), max_new_tokens=140, temperature=1.0, seed=3)
    contig = eagle_jax.generate(tgt, MORE_PROMPTS[:3], **kw)
    paged = eagle_jax.generate(tgt, MORE_PROMPTS[:3], block_size=16, **kw)
    windowed = eagle_jax.generate(tgt, MORE_PROMPTS[:3], block_size=16, attention_window=True, **kw)
    assert paged.token_ids == contig.token_ids
    assert windowed.token_ids == contig.token_ids
    assert len(contig.token_ids[0]) == 140


def test_a_paged_engine_state_holds_only_the_blocks_its_rows_need(oracle):
    tgt, head = oracle
    eng = engine.Engine(tgt, head)
    st = eng.paged_state([10, 33], 4, 256, 300, 16)
    table = np.asarray(st.cache.table)
    assert table.shape == (4, 19)
    np.testing.assert_array_equal(np.asarray(st.draft_cache.table), table)
    assert [(row >= 0).sum() for row in table] == [1, 3, 0, 0]
    assert st.cache.k[0].shape[:2] == (4, 16) and st.draft_cache.k[0].shape[:2] == (4, 16)
    assert st.cache.max_len == st.draft_cache.max_len == 19 * 16 and st.cache.batch == 4


def test_paged_row_surgery_moves_tables_and_rows_and_leaves_the_pools_in_place(oracle):
    from eagle_jax.rows import clear_paged_rows, insert_paged_rows, insert_rows, pools, take_rows, without_pools

    tgt, head = oracle
    eng = engine.Engine(tgt, head)
    st = eng.paged_state([10, 40, 20], 3, 64, 80, 16)
    st = st.replace(cache=st.cache.replace(lengths=jnp.asarray([5, 30, 12], jnp.int32)),
                    root=jnp.asarray([7, 8, 9], jnp.int32))
    table = np.asarray(st.cache.table)
    kept = pools(st)

    moved = take_rows(st, [2, -1, 0, 1])  # a larger bucket: row 1 is new and empty
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(pools(moved)), jax.tree_util.tree_leaves(kept)))
    np.testing.assert_array_equal(np.asarray(moved.cache.table), [table[2], [-1] * table.shape[1], table[0], table[1]])
    np.testing.assert_array_equal(np.asarray(moved.draft_cache.table), np.asarray(moved.cache.table))
    np.testing.assert_array_equal(np.asarray(moved.cache.lengths), [12, 0, 5, 30])
    np.testing.assert_array_equal(np.asarray(moved.root)[[0, 2, 3]], [9, 7, 8])

    newcomer = without_pools(eng.paged_state([16], 1, 64, 80, 16)).replace(root=jnp.asarray([42], jnp.int32))
    newcomer = newcomer.replace(cache=newcomer.cache.replace(table=jnp.asarray([[11] + [-1] * (table.shape[1] - 1)],
                                                                              jnp.int32)))
    placed = insert_paged_rows(moved, newcomer, jnp.asarray([1]))
    assert np.asarray(placed.cache.table)[1, 0] == 11 and int(np.asarray(placed.root)[1]) == 42
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(pools(placed)), jax.tree_util.tree_leaves(kept)))

    cleared = clear_paged_rows(placed, [3])
    assert (np.asarray(cleared.cache.table)[3] == -1).all() and (np.asarray(cleared.draft_cache.table)[3] == -1).all()
    assert int(np.asarray(cleared.cache.lengths)[3]) == 0 and int(np.asarray(cleared.draft_cache.lengths)[3]) == 0
    np.testing.assert_array_equal(np.asarray(cleared.cache.table)[:3], np.asarray(placed.cache.table)[:3])
    with pytest.raises(ValueError, match="use insert_paged_rows for paged ones"):
        insert_rows(st, st, jnp.asarray([0, 1, 2]))


@pytest.mark.parametrize("batch", [1, 5])
def test_speculation_on_a_paged_cache_equals_plain_decoding_at_every_batch_size(oracle, batch):
    tgt, head = oracle
    prompts = MORE_PROMPTS[-batch:]
    plain = eagle_jax.generate(tgt, prompts, max_new_tokens=30, block_size=8)
    spec = eagle_jax.generate(tgt, prompts, draft=head, tree=TreeConfig(3, 2, 7), max_new_tokens=30, block_size=8)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["tau"] > 1.5
