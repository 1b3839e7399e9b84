"""KV-cache blocks: allocation, reference counts, chained hashes, LRU eviction.

Prefix reuse and session reuse are one mechanism. A full block is identified
by a hash chained to its parent's and keyed by the adapter::

    h0 = hash((None, tokens[0:16],  adapter_key))
    h1 = hash((h0,   tokens[16:32], adapter_key))   ...

so a block is shared only by sequences with the same whole prefix *and* the
same adapter (None = base model). A block's hash is recorded once its 16
tokens have been computed; it stays findable after its sequence frees it,
until the block is reused for something else.

Free blocks wait in an LRU queue (front = evicted first). Freed blocks go to
the back in reverse table order, so a sequence's tail is evicted before its
head (the head is what other requests share). Taking a cached block out of
the queue on a hit is O(1) (`OrderedDict`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept to verify a hash hit


def block_hash(parent: int | None, token_ids: Sequence[int], extra_key: Hashable) -> int:
    return hash((parent, tuple(token_ids), extra_key))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    # ---- queries (no side effects) -------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never used, or cached but unreferenced."""
        return len(self.free_queue)

    def prefix_hashes(self, token_ids: Sequence[int], extra_key: Hashable) -> list[int]:
        """Chained hashes of the full blocks of `token_ids`."""
        hashes: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = block_hash(parent, token_ids[start : start + bs], extra_key)
            hashes.append(parent)
        return hashes

    def match_prefix(self, token_ids: Sequence[int], extra_key: Hashable) -> list[int]:
        """Ids of the cached blocks holding the longest cached prefix of `token_ids`.

        At most `len(token_ids) - 1` tokens are matched: the last token is always
        computed, since its logits are needed.
        """
        matched: list[int] = []
        usable = token_ids[: max(len(token_ids) - 1, 0)]
        bs = self.block_size
        for i, h in enumerate(self.prefix_hashes(usable, extra_key)):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(usable[i * bs : (i + 1) * bs]):
                break
            matched.append(block_id)
        return matched

    def num_cached_tokens(self, token_ids: Sequence[int], extra_key: Hashable) -> int:
        return len(self.match_prefix(token_ids, extra_key)) * self.block_size

    def num_blocks_needed(self, block_table: Sequence[int], num_tokens: int) -> int:
        """New blocks `block_table` needs to hold `num_tokens` tokens."""
        return max(-(-num_tokens // self.block_size) - len(block_table), 0)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_queue)

    # ---- actions ---------------------------------------------------------------------

    def allocate_prefix(self, token_ids: Sequence[int], extra_key: Hashable) -> list[int]:
        """Take references on the cached prefix of `token_ids`; returns the new block table."""
        table = self.match_prefix(token_ids, extra_key)
        for block_id in table:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        return table

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks from the front of the LRU queue, evicting their old hashes."""
        if not self.can_allocate(num_blocks):
            raise MemoryError(f"need {num_blocks} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.hash_to_block.get(block.block_hash) == block_id:
                    del self.hash_to_block[block.block_hash]
                block.block_hash = None
                block.token_ids = ()
            block.ref_count = 1
            out.append(block_id)
        return out

    def append(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place so it holds `num_tokens` tokens."""
        block_table.extend(self.allocate(self.num_blocks_needed(block_table, num_tokens)))

    def cache_block(self, block_id: int, h: int, token_ids: Sequence[int]) -> None:
        """Record that `block_id` now holds the computed full block with hash `h`."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = h
        block.token_ids = tuple(token_ids)
        # A twin computed concurrently keeps the entry; this copy is simply not findable.
        self.hash_to_block.setdefault(h, block_id)

    def free(self, block_table: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced ones join the LRU queue tail-first."""
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    # ---- checks ----------------------------------------------------------------------

    def check_invariants(self, live_tables: Sequence[Sequence[int]] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent.

        With `live_tables` (every block table currently held), reference counts must
        equal the number of tables that hold each block: no leak, no double use.
        """
        for block in self.blocks:
            in_queue = block.block_id in self.free_queue
            assert block.ref_count >= 0, f"block {block.block_id} ref_count {block.ref_count}"
            assert in_queue == (block.ref_count == 0), f"block {block.block_id} queue state"
            assert (block.block_hash is None) == (not block.token_ids), "hash without tokens"
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].block_hash == h, f"stale hash entry for {block_id}"
        if live_tables is not None:
            counts = [0] * len(self.blocks)
            for table in live_tables:
                for block_id in table:
                    counts[block_id] += 1
            actual = [b.ref_count for b in self.blocks]
            assert counts == actual, "reference counts differ from the live block tables"
