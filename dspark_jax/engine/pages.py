"""Host bookkeeping of a paged KV cache: which pages of the device pool each request holds.

    pool = PagePool(num_pages=..., page_size=..., table_buckets=(4, 8, 16, ...))
    if pool.can_admit(len(prompt) + gamma + 1): pool.admit(req, len(prompt))
    preempted = pool.reserve({req: committed + gamma + 1 for req in running})   # before a round
    tables = pool.block_tables(reqs, rows=R_bucket)                 # [R_bucket, B_bucket] int32
    pool.free(req)                                                  # finish / cancel / preempt

A page holds `page_size` consecutive positions of one request; a request's block table lists
its pages in position order (position p lives at table[p // page_size], offset p % page_size).
Tables only grow while a request runs (rejected draft positions stay allocated: the next round
overwrites them) and all pages return at once in `free`. When the pool cannot cover a round,
`reserve` preempts the most recently admitted requests (vLLM's recompute policy: the victim's
pages are freed and the caller re-queues it to prefill its prompt plus its output again), so the
oldest requests always make progress.

Static shapes for the device: a table is padded to a page-table bucket (`table_buckets`, the
smallest >= the longest table in the call; padding entries are page 0 and never read because
`kv_lens` stop before them), and the caller pads the rows to its request bucket.

numpy and the standard library only; no engine imports.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from dspark_jax.buckets import bucket_up

__all__ = ["PagePool"]


class PagePool:
    """`num_pages` pages of `page_size` positions. `watermark` pages are kept back from
    admission (not from growth), so newly admitted requests do not force a preemption on their
    first rounds. `table_buckets` (empty: exact widths) are the block tables' static widths."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        table_buckets: Sequence[int] = (),
        watermark: int = 0,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"PagePool: num_pages={num_pages}, page_size={page_size} must be >= 1")
        if not 0 <= watermark < num_pages:
            raise ValueError(f"PagePool: watermark={watermark} must be in [0, num_pages)")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.table_buckets = tuple(sorted(int(b) for b in table_buckets))
        self.watermark = int(watermark)
        # LIFO free list: a freed page is reused first (warm in caches, easy to follow in tests)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}  # insertion order = admission order
        self.preemptions = 0
        self.peak_used = 0

    # ---- counters -------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def running(self) -> list[Hashable]:
        """Requests holding pages, oldest admission first."""
        return list(self._tables)

    def __contains__(self, req: Hashable) -> bool:
        return req in self._tables

    def pages_for(self, n_tokens: int) -> int:
        """Pages that hold positions [0, n_tokens)."""
        return -(-int(n_tokens) // self.page_size)

    def table(self, req: Hashable) -> list[int]:
        """A copy of `req`'s block table (its pages in position order)."""
        return list(self._tables[req])

    def capacity(self, req: Hashable) -> int:
        """Positions `req` can hold without growing."""
        return len(self._tables[req]) * self.page_size

    # ---- admission, growth, release -------------------------------------------------------

    def can_admit(self, n_tokens: int) -> bool:
        """Whether a new request of `n_tokens` positions fits, keeping the watermark free while
        other requests hold pages (it is their growth's reserve: a request admitted into an
        empty pool may use it, else one longer than the rest would never run)."""
        keep = self.watermark if self._tables else 0
        return self.pages_for(n_tokens) <= self.free_pages - keep

    def admit(self, req: Hashable, n_tokens: int) -> None:
        """A new request with room for positions [0, n_tokens). Raises when `req` already holds
        pages or when it does not fit (check `can_admit` first); nothing is allocated then. A
        request whose whole length (prompt + output + γ + 1) exceeds the pool can never finish:
        the caller rejects it before admission."""
        if req in self._tables:
            raise KeyError(f"PagePool.admit: request {req!r} already holds pages; free it first")
        if not self.can_admit(n_tokens):
            raise ValueError(
                f"PagePool.admit: {self.pages_for(n_tokens)} pages for {n_tokens} tokens, "
                f"{self.free_pages} free ({self.watermark} kept back): check can_admit first"
            )
        self._tables[req] = []
        self._grow(req, n_tokens)

    def allocate(self, req: Hashable, n_tokens: int) -> bool:
        """Grow `req`'s table to hold positions [0, n_tokens) (never shrinks). False, with
        nothing allocated, when the free pages do not cover it."""
        if req not in self._tables:
            raise KeyError(f"PagePool.allocate: request {req!r} holds no pages; admit it first")
        if self.pages_for(n_tokens) - len(self._tables[req]) > self.free_pages:
            return False
        self._grow(req, n_tokens)
        return True

    def free(self, req: Hashable) -> int:
        """Return all of `req`'s pages to the pool (finish, cancel, preemption); the count."""
        if req not in self._tables:
            raise KeyError(f"PagePool.free: request {req!r} holds no pages")
        pages = self._tables.pop(req)
        self._free.extend(reversed(pages))
        return len(pages)

    def preemption_victim(self, exclude: Iterable[Hashable] = ()) -> Hashable | None:
        """The most recently admitted running request not in `exclude` (None: none left)."""
        skip = set(exclude)
        for req in reversed(self._tables):
            if req not in skip:
                return req
        return None

    def reserve(self, needs: Mapping[Hashable, int]) -> list[Hashable]:
        """Grow each request in `needs` to hold its positions (e.g. committed + γ + 1 before a
        round), oldest admission first; when the pool runs out, free the most recently admitted
        running request (possibly one of `needs`, possibly the one growing) and retry. Returns
        the preempted requests, newest first: they hold no pages now and must be re-queued."""
        missing = [r for r in needs if r not in self._tables]
        if missing:
            raise KeyError(f"PagePool.reserve: requests {missing!r} hold no pages; admit first")
        preempted: list[Hashable] = []
        order = {r: i for i, r in enumerate(self._tables)}
        for req in sorted(needs, key=order.__getitem__):
            while req in self._tables and not self.allocate(req, needs[req]):
                victim = self.preemption_victim()
                self.free(victim)
                self.preemptions += 1
                preempted.append(victim)
        return preempted

    def _grow(self, req: Hashable, n_tokens: int) -> None:
        table = self._tables[req]
        for _ in range(self.pages_for(n_tokens) - len(table)):
            table.append(self._free.pop())
        self.peak_used = max(self.peak_used, self.used_pages)

    # ---- device views ---------------------------------------------------------------------

    def table_bucket(self, n_pages: int) -> int:
        """The static table width for `n_pages` pages (the smallest bucket >= it)."""
        if not self.table_buckets:
            return max(int(n_pages), 1)
        b = bucket_up(max(int(n_pages), 1), self.table_buckets)
        if b is None:
            raise ValueError(
                f"PagePool: a request holds {n_pages} pages, above the largest page-table bucket "
                f"{self.table_buckets[-1]}: add a bucket >= {n_pages} to table_buckets"
            )
        return b

    def block_tables(
        self, reqs: Sequence[Hashable | None], rows: int | None = None, width: int | None = None
    ) -> np.ndarray:
        """[rows, width] int32: row i is `reqs[i]`'s table (None: a padding row), padded with
        page 0 (never read: `kv_lens` stop before). `rows` defaults to len(reqs), `width` to the
        table bucket of the longest table."""
        tables = [[] if r is None else self._tables[r] for r in reqs]
        rows = len(reqs) if rows is None else rows
        need = max((len(t) for t in tables), default=0)
        width = self.table_bucket(need) if width is None else width
        if rows < len(reqs) or width < need:
            raise ValueError(
                f"PagePool.block_tables: {len(reqs)} requests x {need} pages do not fit "
                f"[{rows}, {width}]"
            )
        out = np.zeros((rows, width), np.int32)
        for i, t in enumerate(tables):
            out[i, : len(t)] = t
        return out

    # ---- invariants -----------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError unless every page is free or owned by exactly one request."""
        owned = [p for t in self._tables.values() for p in t]
        seen = np.zeros(self.num_pages, np.int64)
        np.add.at(seen, np.asarray(owned + self._free, np.int64), 1)
        twice = np.flatnonzero(seen > 1).tolist()
        lost = np.flatnonzero(seen == 0).tolist()
        assert not twice, f"PagePool: pages {twice} owned or freed twice"
        assert not lost, f"PagePool: pages {lost} leaked (neither free nor owned)"

    def stats(self) -> dict[str, int]:
        return dict(
            num_pages=self.num_pages,
            free_pages=self.free_pages,
            used_pages=self.used_pages,
            peak_used_pages=self.peak_used,
            running=len(self._tables),
            preemptions=self.preemptions,
        )
