"""Faults inside a step end only the requests they touch (issue 42, item 2), on both KV layouts:
non-finite logits of one row (a target whose embedding of one token id is NaN: a real forward
that turns NaN for the requests reading that token and for no other), and device errors raised
from a prefill or a round (`EnginePrograms.set_fault`: before the call, or after it, when the
donated state is gone). The other requests keep exactly their greedy tokens, new ones are
served, and no slot or page is left held."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.models.generate import generate
from tests.engine_models import agreeing_pair

G = 4
POISON = 61  # the clean target emits it only after [1, 2] (its 9th token)
CLEAN = [[3, 9, 1], [5, 6, 7, 8, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
TURNS_NAN = [1, 2]  # its 9th token is POISON: its logits turn NaN inside a round
NAN_PROMPT = [2, POISON, 5, 7, 9, 1, 3, 4, 8, 10]  # NaN in its first chunk of two
MAX_NEW = 24
KW = dict(num_slots=3, max_len=64, prompt_buckets=(4, 8), token_buckets=(15,),
          cache_buckets=(64,), modes=("greedy",), policy="fixed")  # fmt: skip


@pytest.fixture(scope="module")
def pair():
    tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=G)
    emb = tp["embed_tokens"]
    tp["embed_tokens"] = emb.replace(emb[...].at[POISON].set(jnp.nan))
    return tcfg, tp, dcfg, dp


@pytest.fixture(scope="module")
def refs(pair):
    tcfg, tp, _, _ = pair
    out = {tuple(p): generate(tcfg, tp, [p], max_new_tokens=MAX_NEW)[0] for p in CLEAN}
    assert all(POISON not in r for r in out.values())
    return out


@pytest.fixture(scope="module", params=["slots", "paged_k2"])
def engine(pair, request):
    """The slot layout with one round per call; the paged one with up to two device-resident
    rounds per call (`engine.paged_rounds`: a faulty row ends the call's loop)."""
    tcfg, tp, dcfg, dp = pair
    kw = (dict(kv_layout="paged", page_size=8, rounds_per_call=2) if "paged" in request.param
          else dict(kv_layout="slots"))  # fmt: skip
    eng = ServingEngine(tcfg, dcfg, tp, dp, **KW, **kw)
    eng.warmup()
    return eng


def _submit(eng, prompt):
    return eng.submit(prompt, RequestParams(MAX_NEW, temperature=0.0))


def _drain(eng):
    while eng.has_work():
        eng.step()


def _all_free(eng):
    assert not eng.has_work() and eng.slots.running() == [] and not eng.slots.by_id
    if eng.page_pool is not None:
        eng.page_pool.check()
        assert eng.page_pool.used_pages == 0


class _OneShot:
    """A fault hook: the first call of `program` raises `exc` (after running it: `after`)."""

    def __init__(self, programs, exc, *, after=False):
        self.programs, self.exc, self.after, self.fired = programs, exc, after, False

    def __call__(self, name, run):
        if name in self.programs and not self.fired:
            self.fired = True
            if self.after:
                jax.block_until_ready(run())  # the state was donated to this call
            raise self.exc
        return run()


def test_nonfinite_rows_end_with_error_and_the_others_are_exact(engine, refs):
    before = engine.metrics().requests_errored_by_cause["nonfinite"]
    hs = [_submit(engine, p) for p in (CLEAN[0], TURNS_NAN, NAN_PROMPT)]
    engine.step()
    hs += [_submit(engine, p) for p in CLEAN[1:]]
    _drain(engine)
    outs = [h.result() for h in hs]
    for o, p in zip([outs[0]] + outs[3:], CLEAN):
        assert o.finish_reason == "length" and o.tokens == refs[tuple(p)]
    bad, at_admission = outs[1], outs[2]
    assert bad.finish_reason == "error" and "non-finite" in bad.error
    assert POISON not in bad.tokens and len(bad.tokens) <= 9  # what it had before the fault
    assert at_admission.finish_reason == "error" and at_admission.tokens == []
    assert engine.metrics().requests_errored_by_cause["nonfinite"] == before + 2
    _all_free(engine)
    # the faulty rows' slots (and pages) serve new requests exactly
    hs = [_submit(engine, p) for p in CLEAN]
    _drain(engine)
    assert [h.result().tokens for h in hs] == [refs[tuple(p)] for p in CLEAN]
    _all_free(engine)


def test_out_of_memory_on_admission_ends_only_that_request(engine, refs):
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1.0GiB")
    first = _submit(engine, CLEAN[0])
    engine.step()
    engine.step()
    engine.programs.set_fault(_OneShot(("prefill",), oom))
    try:
        failed = _submit(engine, CLEAN[1])
        later = _submit(engine, CLEAN[2])
        _drain(engine)
    finally:
        engine.programs.set_fault(None)
    out = failed.result()
    assert out.finish_reason == "error" and "out of memory" in out.error
    assert first.result().tokens == refs[tuple(CLEAN[0])]  # its slot kept its state
    assert later.result().tokens == refs[tuple(CLEAN[2])]
    assert engine.metrics().requests_errored_by_cause["oom"] >= 1
    _all_free(engine)


@pytest.mark.parametrize("after", [False, True], ids=["before_call", "state_donated"])
def test_device_error_in_a_round_ends_its_requests_and_the_engine_serves_on(
    engine, refs, after
):  # fmt: skip
    failed_before = engine.metrics().requests_errored_by_cause["device"]
    running = [_submit(engine, p) for p in CLEAN]
    engine.step()
    queued = _submit(engine, CLEAN[1])  # waits for a slot: not in the failed call
    hook = _OneShot(("round", "rounds"), RuntimeError("INTERNAL: a failed launch"), after=after)
    engine.programs.set_fault(hook)
    state = engine.programs.state
    try:
        engine.step()
    finally:
        engine.programs.set_fault(None)
    assert hook.fired
    assert (engine.programs.state is not state) == after  # a consumed state is rebuilt
    for h in running:
        out = h.result(timeout=0)
        assert out.finish_reason == "error" and "device failed" in out.error
    assert engine.metrics().requests_errored_by_cause["device"] == failed_before + 3
    fresh = _submit(engine, CLEAN[0])
    _drain(engine)
    assert queued.result().tokens == refs[tuple(CLEAN[1])]
    assert fresh.result().tokens == refs[tuple(CLEAN[0])]
    _all_free(engine)


def test_fail_from_the_caller_ends_the_request_and_counts_it(engine):
    """`ServingEngine.fail` (the server's detokenization fault): a running request ends with an
    error at the next step; one the engine had already finished is still counted."""
    count = lambda: engine.metrics().requests_errored_by_cause["detokenize"]  # noqa: E731
    before = count()
    h = _submit(engine, CLEAN[0])
    engine.step()
    engine.fail(h.id, "detokenize")
    engine.step()
    out = h.result(timeout=0)
    assert out.finish_reason == "error" and "could not decode" in out.error
    engine.fail(h.id, "detokenize")  # finished already: its caller still got an error
    assert count() == before + 2
    with pytest.raises(ValueError, match="unknown error cause"):
        engine.fail(h.id, "bogus")
    _all_free(engine)
