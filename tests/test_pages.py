"""The host page allocator: exact bookkeeping, preemption of the newest, and random serving
traces (admit / grow by γ+1 / finish / cancel / preempt) that end with every page free."""

from collections import deque

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dspark_jax.engine.pages import PagePool


def test_admit_grow_free_and_tables():
    pool = PagePool(10, 4, table_buckets=(2, 4, 8))
    assert pool.pages_for(0) == 0 and pool.pages_for(1) == 1 and pool.pages_for(8) == 2
    pool.admit("a", 5)  # 2 pages
    pool.admit("b", 4)  # 1 page
    assert pool.table("a") == [0, 1] and pool.table("b") == [2]
    assert pool.allocate("a", 8) and pool.table("a") == [0, 1]  # already fits
    assert pool.allocate("a", 9) and pool.table("a") == [0, 1, 3]
    assert pool.capacity("a") == 12 and pool.free_pages == 6
    t = pool.block_tables(["b", None, "a"], rows=4)
    np.testing.assert_array_equal(t, [[2, 0, 0, 0], [0, 0, 0, 0], [0, 1, 3, 0], [0, 0, 0, 0]])
    assert t.dtype == np.int32
    assert not pool.allocate("b", 8 * 4)  # 7 more pages, 6 free: nothing taken
    assert pool.table("b") == [2] and pool.free_pages == 6
    assert pool.free("a") == 3 and pool.free_pages == 9
    pool.admit("c", 1)
    assert pool.table("c") == [0]  # freed pages are reused first
    pool.check()
    with pytest.raises(KeyError, match="already holds"):
        pool.admit("c", 1)
    with pytest.raises(ValueError, match="can_admit"):
        pool.admit("d", 9 * 4)
    with pytest.raises(ValueError, match="add a bucket >= 9"):
        pool.table_bucket(9)
    with pytest.raises(KeyError):
        pool.free("a")


def test_watermark_holds_back_admission_not_growth():
    pool = PagePool(5, 2, watermark=1)
    assert pool.can_admit(10)  # an empty pool: the watermark protects no one yet
    pool.admit("z", 2)
    assert pool.can_admit(6) and not pool.can_admit(7)
    pool.admit("a", 6)
    assert not pool.can_admit(1)
    assert pool.allocate("a", 8) and pool.free_pages == 0


def test_reserve_preempts_the_most_recently_admitted():
    pool = PagePool(10, 4)
    for req, n in (("a", 16), ("b", 12), ("c", 8)):  # 4 + 3 + 2 pages
        pool.admit(req, n)
    assert pool.preemption_victim() == "c" and pool.preemption_victim(exclude=["c"]) == "b"
    # a takes the last free page; b needs one more: c (newest) is preempted
    assert pool.reserve({"c": 12, "b": 16, "a": 20}) == ["c"]
    assert len(pool.table("a")) == 5 and len(pool.table("b")) == 4 and "c" not in pool
    assert pool.free_pages == 1
    # a takes the free page; b, now the newest, preempts itself
    assert pool.reserve({"a": 24, "b": 20}) == ["b"]
    assert pool.running == ["a"] and pool.preemptions == 2
    pool.check()


def _serve(pool, seed, n_requests=1000, gamma=4):
    """A serving trace: FIFO admission, a round reserves committed + γ + 1 for every running
    request, commits 1..γ+1 tokens each, finishes or cancels some; preempted requests go back
    to the front of the queue and recompute (prompt + output so far). Checks the pool every
    round; returns the number of finished and cancelled requests."""
    rng = np.random.default_rng(seed)
    max_len = pool.num_pages * pool.page_size // 2
    queue = deque()
    for i in range(n_requests):
        prompt = int(rng.integers(1, max_len // 2))
        queue.append([i, prompt, int(rng.integers(1, max_len - prompt - gamma))])
    running: dict[int, list[int]] = {}  # id -> [committed positions, tokens left to generate]
    done = cancelled = 0
    while queue or running:
        while queue and pool.can_admit(queue[0][1] + gamma + 1):
            i, length, left = queue.popleft()
            pool.admit(i, length)
            running[i] = [length, left]
        if not running:
            raise AssertionError("a request that fits an empty pool was not admitted")
        for v in pool.reserve({i: c + gamma + 1 for i, (c, _) in running.items()}):
            c, left = running.pop(v)
            queue.appendleft([v, c, left])  # recompute: its committed tokens are its new prompt
        for i in list(running):
            state = running[i]
            step = min(int(rng.integers(1, gamma + 2)), state[1])
            state[0] += step
            state[1] -= step
            assert state[0] <= pool.capacity(i)
            if state[1] == 0 or rng.random() < 0.01:  # finished or cancelled mid-decode
                done += state[1] == 0
                cancelled += state[1] > 0
                del running[i]
                pool.free(i)
        if queue and rng.random() < 0.01:  # cancelled while waiting (perhaps preempted)
            queue.remove(queue[int(rng.integers(len(queue)))])
            cancelled += 1
        pool.check()
    return done, cancelled


def test_a_thousand_requests_with_cancellations_free_every_page():
    pool = PagePool(64, 8, table_buckets=(4, 8, 16, 32, 64))
    done, cancelled = _serve(pool, 0)
    assert done + cancelled == 1000 and done > 500 and cancelled > 100
    assert pool.free_pages == 64 and pool.running == [] and pool.peak_used == 64
    assert pool.preemptions > 10  # the trace really exercised preemption


def test_check_catches_double_ownership_and_leaks():
    pool = PagePool(4, 2)
    pool.admit("a", 2)
    pool._tables["b"] = [pool._free[-1]]  # owned and free at once
    with pytest.raises(AssertionError, match="twice"):
        pool.check()
    pool._tables.pop("b")
    pool._free.pop()  # neither free nor owned
    with pytest.raises(AssertionError, match="leaked"):
        pool.check()


@given(
    st.lists(st.tuples(st.sampled_from("agfr"), st.integers(0, 7), st.integers(0, 40)), max_size=60)
)
def test_random_operations_keep_pages_owned_once(ops):
    """Any sequence of admit / allocate (grow) / free / reserve keeps every page free or owned
    by exactly one request, each table exactly as long as its largest request."""
    pool = PagePool(12, 4)
    want: dict[int, int] = {}
    for op, req, n in ops:
        if op == "a" and req not in pool and pool.can_admit(n):
            pool.admit(req, n)
            want[req] = n
        elif op == "g" and req in pool:
            if pool.allocate(req, n):
                want[req] = max(want[req], n)
        elif op == "f" and req in pool:
            pool.free(req)
            del want[req]
        elif op == "r" and want:
            needs = {r: want[r] + n % 9 for r in want}
            for v in pool.reserve(needs):
                del want[v]
            want.update({r: max(want[r], needs[r]) for r in want})
        pool.check()
        assert set(pool.running) == set(want)
        for r, n_tok in want.items():
            assert len(pool.table(r)) == pool.pages_for(n_tok)
    for r in list(want):
        pool.free(r)
    assert pool.free_pages == 12
    pool.check()
