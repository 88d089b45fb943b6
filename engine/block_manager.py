"""Physical KV pages: free pool, reference counts, prefix-cache hashes, copy-on-compress support.

A page ("block") is `block_size` token slots for every layer and KV head. Pages are reference
counted: a prefix-cached prompt page may be shared by several requests, and a shared page is never
written in place (compaction copies its kept slots to fresh pages instead, see engine.compaction).

Prefix caching: a full prompt page is identified by a chained hash of (previous page hash, its token
ids); a hit also compares the token ids (collision guard). A freed page keeps its hash until it is
reused, so a later request with the same prefix can still hit it; the free pool hands out the
longest-free page first so recently freed cached pages survive longest.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence


class OutOfPages(RuntimeError):
    """No free page is left in the pool."""


@dataclass
class Page:
    page_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(prev: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Hash of one full page given the hash of the page before it (None for the first page)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev or b"")
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class BlockManager:
    def __init__(self, num_pages: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.pages = [Page(i) for i in range(num_pages)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        self._by_hash: dict[bytes, int] = {}

    # -- pool ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self) -> int:
        """Take a fresh page (ref_count 1); its old prefix-cache identity is forgotten."""
        if not self._free:
            raise OutOfPages("the KV pool has no free page")
        page_id, _ = self._free.popitem(last=False)
        page = self.pages[page_id]
        self._forget_hash(page)
        page.ref_count = 1
        return page_id

    def release(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.ref_count <= 0:
            raise RuntimeError(f"page {page_id} released more often than it was taken")
        page.ref_count -= 1
        if page.ref_count == 0:
            self._free[page_id] = None

    def is_shared(self, page_id: int) -> bool:
        return self.pages[page_id].ref_count > 1

    def make_private(self, page_id: int) -> None:
        """The page is about to be overwritten: it must no longer answer prefix-cache lookups."""
        self._forget_hash(self.pages[page_id])

    # -- sequences ----------------------------------------------------------------------------
    def pages_needed(self, seq: Sequence, new_tokens: int) -> int:
        """Pages to add so `new_tokens` more slots fit after `seq.physical_len`."""
        need = -(-(seq.physical_len + new_tokens) // self.block_size)
        return max(0, need - seq.num_pages)

    def grow(self, seq: Sequence, num_pages: int) -> None:
        if num_pages > self.num_free:
            raise OutOfPages(f"need {num_pages} pages, {self.num_free} free")
        seq.block_table.extend(self.allocate() for _ in range(num_pages))

    def free_sequence(self, seq: Sequence) -> None:
        for page_id in reversed(seq.block_table):
            self.release(page_id)
        seq.block_table = []

    # -- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached pages for the longest cached run of full pages of `seq`'s tokens.

        Only called on an empty sequence. The page holding the last token is never served from
        cache, so at least one token is computed (its logits are needed). Returns tokens reused.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        bs = self.block_size
        prev = None
        matched = 0
        for start in range(0, len(seq.token_ids) - 1 - bs + 1, bs):
            tokens = tuple(seq.token_ids[start:start + bs])
            h = chain_hash(prev, tokens)
            page_id = self._by_hash.get(h)
            if page_id is None or self.pages[page_id].token_ids != tokens:
                break
            self._take(page_id)
            seq.block_table.append(page_id)
            prev = h
            matched += bs
        return matched

    def register_prompt_pages(self, seq: Sequence) -> None:
        """Make newly completed full prompt pages of an uncompressed sequence hit-able."""
        if not self.enable_prefix_caching or seq.is_compressed:
            return
        bs = self.block_size
        full = min(seq.num_computed, seq.num_prompt_tokens) // bs
        prev = None
        for i in range(full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(prev, tokens)
            page = self.pages[seq.block_table[i]]
            if page.hash is None and h not in self._by_hash:
                page.hash, page.token_ids = h, tokens
                self._by_hash[h] = page.page_id
            prev = h

    def _take(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.ref_count == 0:
            del self._free[page_id]
        page.ref_count += 1

    def _forget_hash(self, page: Page) -> None:
        if page.hash is not None and self._by_hash.get(page.hash) == page.page_id:
            del self._by_hash[page.hash]
        page.hash, page.token_ids = None, ()
