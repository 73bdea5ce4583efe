"""Paged KV-cache blocks: allocation, reference counts and prefix caching over full blocks.

A full block is identified by a hash chained over its parent's hash and its own tokens, so equal
hashes mean equal whole prefixes. The hash is SHA-256: with Python's hash() a client could craft a prompt
whose blocks collide with another's and be handed that request's KV. Freed blocks keep their hash and stay
reusable until the allocator needs them again; eviction takes the least recently freed first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastdeploy.engine.request import Request
from fastdeploy.step_types import block_table_array


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def chain_hash(parent_hash: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent_hash + array("q", tokens).tobytes()).digest()


def root_hash(request: Request) -> bytes:
    """The parent hash of a request's first block: its media's content hash (images / videos), so prompts
    whose tokens match but whose pixels differ never share a block, and its cache_salt, so only requests
    with the same salt share cached blocks (and can tell from timing that a prefix was sent before)."""
    if request.mm is None and request.cache_salt is None:
        return b""
    digest = hashlib.sha256(b"mm" + (request.mm.content_hash if request.mm is not None else b""))
    if request.cache_salt is not None:
        digest.update(b"salt" + request.cache_salt.encode())
    return digest.digest()


class BlockManager:
    """Owns the pool and each request's block table (by request id); hashes live on the blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of each table that carry their hash
        self.num_cached_free = 0  # free blocks that still hold a cached prefix (reusable until evicted)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def table_array(self, request_ids: Sequence[str]) -> np.ndarray:
        """int64 [requests, widest table]: the requests' block tables, zero-padded."""
        return block_table_array([self.block_table(r) for r in request_ids])

    def match_prefix(self, request: Request) -> list[int]:
        """Ids of cached blocks holding a prefix of the request's tokens. At least one token is
        always left to compute, because the step that computes it also yields the next logits."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return []  # prompt logprobs need every prompt position computed
        hits: list[int] = []
        parent = root_hash(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            parent = chain_hash(parent, request.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _new_blocks(self, request: Request, num_new_tokens: int, prefix_hits: Sequence[int]) -> int:
        """Fresh blocks the request needs, beyond its table and the prefix hits it adopts, for num_new_tokens
        more tokens after its computed ones."""
        num_target = request.num_computed_tokens + len(prefix_hits) * self.block_size + num_new_tokens
        return max(self.blocks_needed(num_target) - len(self.block_table(request.request_id)) - len(prefix_hits), 0)

    def _revived(self, prefix_hits: Sequence[int]) -> int:
        """Prefix hits no request holds: adopting them takes them out of the free list too."""
        return sum(self.blocks[b].ref_count == 0 for b in prefix_hits)

    def free_after(self, request: Request, num_new_tokens: int, prefix_hits: Sequence[int] = ()) -> int:
        """Free blocks left if the request got blocks for num_new_tokens more tokens and the prefix hits."""
        return len(self.free) - self._new_blocks(request, num_new_tokens, prefix_hits) - self._revived(prefix_hits)

    def allocate(self, request: Request, num_new_tokens: int, prefix_hits: Sequence[int] = ()) -> bool:
        """Give the request blocks for num_new_tokens more tokens after its computed ones and the
        prefix hits it adopts (when it has no blocks yet). False, with nothing changed, if the pool is
        too small."""
        num_new_blocks = self._new_blocks(request, num_new_tokens, prefix_hits)
        if num_new_blocks + self._revived(prefix_hits) > len(self.free):
            return False
        table = self._tables.setdefault(request.request_id, [])
        for block_id in prefix_hits:
            self._take(block_id)
            table.append(block_id)
        if prefix_hits:
            self._num_hashed[request.request_id] = len(prefix_hits)
        for _ in range(num_new_blocks):
            block_id = next(iter(self.free))
            block = self.blocks[block_id]
            self._take(block_id)
            if block.block_hash is not None:  # evict its cached contents
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
            table.append(block_id)
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
            self.num_cached_free -= block.block_hash is not None
        block.ref_count += 1

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks (their K/V are computed) for reuse."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_hashed.get(request.request_id, 0)
        parent = self.blocks[table[done - 1]].block_hash if done else root_hash(request)
        for i in range(done, num_full):
            parent = chain_hash(parent, request.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self.blocks[table[i]]
            if block.block_hash is None:
                block.block_hash = parent
                self.cached.setdefault(parent, block.block_id)
        self._num_hashed[request.request_id] = max(done, num_full)

    def trim(self, request: Request) -> None:
        """Free the request's blocks past its known tokens: a step took them for drafts that were rejected
        (never hashed, never shared), and holding them could push another request out of the cache."""
        table = self._tables.get(request.request_id)
        keep = self.blocks_needed(request.num_tokens)
        while table and len(table) > keep:
            block_id = table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)

    def release(self, request_id: str) -> None:
        """Drop the request's blocks; tail blocks go first in line for eviction."""
        for block_id in reversed(self._tables.pop(request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.block_hash is None:
                    self.free.move_to_end(block_id, last=False)  # no contents worth keeping
                else:
                    self.num_cached_free += 1
        self._num_hashed.pop(request_id, None)
