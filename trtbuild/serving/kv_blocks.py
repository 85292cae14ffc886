"""The KV cache as fixed-size blocks from one pool, with prefix caching: what a paged engine's block tables hold.

Each running request owns a block table, the pool's blocks that hold its positions in order (position p in
block table[p // block_size], at offset p % block_size). A request takes blocks as its sequence grows and
gives them back when it ends, so how many requests run together is set by the tokens they hold, not by a
row of the engine's full length each.

Prefix caching: a full block is named by a hash of its tokens and of every token before it (the hash of the
block before it), so two requests whose prompts start alike name their first blocks alike. A block whose
request ended keeps its contents and its name in an LRU; a later prompt that starts with named blocks takes
them (a reference count shares one block between requests) and prefills only the rest. A block is reused for
other tokens only when no free block is left, the least recently used first.

Pure bookkeeping on the host: no tensors here (the engine holds the pool; models/paged.py reads through it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Table:
    """One request's blocks. `cached`: the prompt's tokens found in the prefix cache (not prefilled again);
    `named`: how many of the leading blocks carry their hash (full, and offered to the prefix cache)."""

    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    named: int = 0
    hashes: list[bytes] = field(default_factory=list)  # of blocks[:named]


def chain_hashes(tokens: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The name of each full block of `tokens`: blake2b of the block before's name and this block's ids."""
    out = []
    for i in range(len(tokens) // block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens. Not thread-safe: the scheduler's engine thread owns it."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest block first
        self._refs = [0] * num_blocks
        self._name: dict[int, bytes] = {}  # block -> its hash, for the blocks in the prefix cache
        self._by_name: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named blocks no request holds: the LRU, oldest first
        self.hits = 0  # prompt blocks found in the prefix cache
        self.misses = 0  # full prompt blocks that were not there

    # -- what admission reads ---------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """Blocks a request can take now: never used, or cached with no request holding them."""
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _cached_prefix(self, prompt: list[int]) -> tuple[list[int], list[bytes]]:
        """The blocks of the prompt's longest named prefix, leaving at least its last token to compute (the
        first generated token comes from its logits)."""
        if not self.prefix_caching:
            return [], []
        blocks, hashes = [], []
        for h in chain_hashes(prompt[:len(prompt) - 1], self.block_size):
            b = self._by_name.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
        return blocks, hashes

    def can_admit(self, prompt: list[int], reserve: int = 0) -> bool:
        """Whether blocks for the prompt (and `reserve` tokens more) can be had now, its cached prefix counted."""
        have, _ = self._cached_prefix(prompt)
        idle_taken = sum(1 for b in have if b in self._idle)
        return self.blocks_for(len(prompt) + reserve) - len(have) <= self.free - idle_taken

    # -- a request's life ---------------------------------------------------------------------------------------
    def admit(self, prompt: list[int], reserve: int = 0) -> Table | None:
        """A table for the prompt and `reserve` tokens more (the prefix cache's blocks first), or None when the
        pool has too few blocks (nothing is taken then)."""
        if not self.can_admit(prompt, reserve):
            return None
        have, hashes = self._cached_prefix(prompt)
        full = (len(prompt) - 1) // self.block_size if self.prefix_caching else 0
        self.hits += len(have)
        self.misses += full - len(have)
        for b in have:
            self._hold(b)
        table = Table(blocks=list(have), cached=len(have) * self.block_size, named=len(have), hashes=list(hashes))
        for _ in range(self.blocks_for(len(prompt) + reserve) - len(have)):
            table.blocks.append(self._take())
        return table

    def grow(self, table: Table, tokens: int) -> bool:
        """Make the table hold `tokens` positions; False (and nothing taken) when the pool has too few blocks."""
        need = self.blocks_for(tokens) - len(table.blocks)
        if need > self.free:
            return False
        for _ in range(need):
            table.blocks.append(self._take())
        return True

    def name_full_blocks(self, table: Table, tokens: list[int]) -> None:
        """Offer the table's full blocks (those `tokens`, the sequence so far, fills and its KV holds) to the
        prefix cache. A block whose name another block already has stays unnamed (freed at the end)."""
        if not self.prefix_caching:
            return
        full = min(len(tokens) // self.block_size, len(table.blocks))
        if full <= table.named:
            return
        parent = table.hashes[-1] if table.hashes else b""
        start = table.named * self.block_size
        for i, h in enumerate(chain_hashes(tokens[start:full * self.block_size], self.block_size, parent)):
            b = table.blocks[table.named + i]
            if h not in self._by_name and b not in self._name:
                self._by_name[h] = b
                self._name[b] = h
            table.hashes.append(h)
        table.named = full

    def release(self, table: Table) -> None:
        """The request ended (or was preempted): its named blocks stay cached, the others are free."""
        for b in reversed(table.blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._name:
                    self._idle[b] = None  # the most recently used end of the LRU
                else:
                    self._free.append(b)
        table.blocks, table.named, table.hashes = [], 0, []

    # -- blocks -------------------------------------------------------------------------------------------------
    def _hold(self, b: int) -> None:
        if self._refs[b] == 0:
            self._idle.pop(b, None)
        self._refs[b] += 1

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:  # evict the least recently used cached block: its contents are about to be overwritten
            b, _ = self._idle.popitem(last=False)
            del self._by_name[self._name.pop(b)]
        self._refs[b] = 1
        return b
