"""Exact block ids, free order, prefix hits, LRU eviction, and a random-ops soak."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_runtime import BlockManager


def _fill(bm: BlockManager, table: list[int], tokens: list[int], key: str | None) -> None:
    """Mark every full block of `tokens` in `table` as computed (what the runtime does)."""
    for i, h in enumerate(bm.prefix_hashes(tokens, key)):
        bm.cache_block(table[i], h, tokens[i * bm.block_size : (i + 1) * bm.block_size])


def test_allocate_and_free_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate(3)
    b = bm.allocate(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    bm.free(a)  # tail first: the LRU queue is now 5, 6, 7, 2, 1, 0
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0]
    assert bm.allocate(4) == [5, 6, 7, 2]
    assert bm.num_free_blocks == 2
    assert not bm.can_allocate(3)
    bm.check_invariants([b, [5, 6, 7, 2]])


def test_append_grows_table_in_place():
    bm = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    bm.append(table, 5)
    assert table == [0, 1]
    bm.append(table, 8)
    assert table == [0, 1]
    bm.append(table, 9)
    assert table == [0, 1, 2]
    assert bm.num_blocks_needed(table, 20) == 2


def test_prefix_hit_reuses_blocks_and_adapter_isolates():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    table = bm.allocate_prefix(tokens, None)
    assert table == []
    bm.append(table, 10)
    _fill(bm, table, tokens, None)
    assert table == [0, 1, 2]
    bm.free(table)
    # Blocks 0 and 1 are full and cached; block 2 held only 2 tokens.
    assert bm.num_cached_tokens([*tokens, 99], None) == 8
    assert bm.num_cached_tokens([*tokens, 99], "adapter-a") == 0
    assert bm.num_cached_tokens(tokens[:8], None) == 4  # the last token is always computed
    assert bm.num_cached_tokens([7, *tokens[1:]], None) == 0  # chained: a new head, no hits
    hit = bm.allocate_prefix([*tokens, 99], None)
    assert hit == [0, 1]
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 2]
    bm.check_invariants([hit])


def test_lru_eviction_drops_oldest_hash_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = [1, 2, 3], [4, 5, 6]
    for tokens in (old, new):
        t = bm.allocate_prefix(tokens, None)
        bm.append(t, len(tokens))
        _fill(bm, t, tokens, None)
        bm.free(t)
    # Queue: old's blocks (freed first) at the front.
    assert list(bm.free_queue) == [1, 0, 3, 2]
    bm.allocate(1)  # evicts block 1 (old's partial block, no hash)
    assert bm.num_cached_tokens(old, None) == 2
    bm.allocate(1)  # evicts block 0: old's cached block
    assert bm.num_cached_tokens(old, None) == 0
    assert bm.num_cached_tokens(new, None) == 2
    bm.check_invariants()


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_random_ops_never_leak(seed, num_blocks, block_size):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    live: dict[int, tuple[list[int], list[int], str | None]] = {}  # id -> (tokens, table, key)
    next_id = 0
    for _ in range(1000):
        op = rng.random()
        if op < 0.4:  # add: a prompt drawn from few tokens, so prefixes are shared
            key = rng.choice([None, "a"])
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            table = bm.allocate_prefix(tokens, key)
            if bm.can_allocate(bm.num_blocks_needed(table, len(tokens))):
                bm.append(table, len(tokens))
                _fill(bm, table, tokens, key)
                live[next_id] = (tokens, table, key)
                next_id += 1
            else:
                bm.free(table)
        elif op < 0.7 and live:  # grow by one token
            tokens, table, key = live[rng.choice(list(live))]
            if bm.can_allocate(bm.num_blocks_needed(table, len(tokens) + 1)):
                tokens.append(rng.randrange(3))
                bm.append(table, len(tokens))
                _fill(bm, table, tokens, key)
        elif live:  # finish or evict (preempt): both free the table
            _, table, _ = live.pop(rng.choice(list(live)))
            bm.free(table)
        bm.check_invariants([t for _, t, _ in live.values()])
    for _, table, _ in live.values():
        bm.free(table)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
