"""The serving engine runs a tied LM head from an untied [H, V] copy on CPU
(`transformer.untie_lm_head`, `serving.untie_applies`): the same logits, the same tokens as the
tied model (greedy and sampled), and the compiled round reads the head in [in, out] order."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from dspark_jax import drafters
from dspark_jax.engine import ServingEngine
from dspark_jax.engine import engine as engine_lib
from dspark_jax.engine.device import RoundInputs
from dspark_jax.models import transformer as tf
from dspark_jax.models.generate import generate
from dspark_jax.testing import (
    positions_like,
    random_params,
    random_tokens,
    tiny_drafter_config,
    tiny_target_config,
)

G = 4
PROMPTS = [[3, 9, 1], [5, 6, 7, 8, 2, 11, 12], [7] * 12]
KW = dict(  # the slot layout: its round program is lowered below
    num_slots=1, max_len=64, prompt_buckets=(16,), token_buckets=(G + 1,), cache_buckets=(64,),
    kv_layout="slots",
)  # fmt: skip


def _tied():
    tcfg = tiny_target_config("qwen3")  # tied head
    assert tcfg.tie_word_embeddings
    tp = random_params(tcfg, 0)
    dcfg = tiny_drafter_config("dspark", tcfg, block_size=G)
    return tcfg, tp, dcfg, drafters.init_params(dcfg, seed=1, target_params=tp)


def test_untie_lm_head_gives_the_same_logits():
    tcfg, tp, _, _ = _tied()
    ucfg, up = tf.untie_lm_head(tcfg, tp)
    assert (
        not ucfg.tie_word_embeddings and dataclasses.replace(ucfg, tie_word_embeddings=True) == tcfg
    )
    head = np.asarray(up["lm_head"]["kernel"][...])
    np.testing.assert_array_equal(head, np.asarray(tp["embed_tokens"][...]).T)
    ids = random_tokens(0, (2, 9), tcfg.vocab_size)
    a = tf.forward(tcfg, tp, ids, positions_like(ids))[0]
    b = tf.forward(ucfg, up, ids, positions_like(ids))[0]
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), rtol=1e-5, atol=1e-5)
    # an untied model is returned as it is
    assert tf.untie_lm_head(ucfg, up) == (ucfg, up)


def _head_dots(eng, mode="greedy"):
    """The compiled one-round program's dots that produce [T, V] from the target's final hidden
    state: their rhs contracting dimension (1 = the tied [V, H] table read transposed)."""
    t = G + 1
    progs = eng.programs
    inputs = RoundInputs(np.full(1, G, np.int32), np.ones(1, bool), np.zeros(1, np.uint32), None,
                         progs.key)  # fmt: skip
    lowered = progs.lower_round(progs.state, inputs, mode=mode, num_tokens=t,
                                cache_len=eng.max_len)  # fmt: skip
    text = lowered.compile().as_text()
    v = eng.tcfg.vocab_size
    return re.findall(rf"= f32\[{t},{v}\]\S* dot\(.*?rhs_contracting_dims=\{{(\d)\}}", text)


def test_the_engine_runs_a_tied_head_untied_on_cpu_with_the_same_tokens(monkeypatch):
    tcfg, tp, dcfg, dp = _tied()
    eng = ServingEngine(tcfg, dcfg, tp, dp, **KW)
    assert jax.default_backend() == "cpu" and engine_lib.untie_applies(tcfg, tp)
    assert not eng.tcfg.tie_word_embeddings
    assert _head_dots(eng) == ["0"]  # the [H, V] copy, not the transposed table
    monkeypatch.setattr(engine_lib, "UNTIE_MAX_BYTES", 0)  # a table over the cap: kept tied
    tied = ServingEngine(tcfg, dcfg, tp, dp, **KW)
    assert tied.tcfg == tcfg and _head_dots(tied) == ["1"]
    for p in PROMPTS:
        want = generate(tcfg, tp, [p], max_new_tokens=20)[0]
        got = [e.generate([p], max_new_tokens=20, temperature=0.0)[0].tokens for e in (eng, tied)]
        assert got == [want, want]
        sampled = [e.generate([p], max_new_tokens=20, temperature=1.0, seeds=[3])[0].tokens
                   for e in (eng, tied)]  # fmt: skip
        assert sampled[0] == sampled[1]


def test_an_untied_target_is_left_as_it_is():
    tcfg = tiny_target_config("qwen2")
    tp = random_params(tcfg, 0)
    assert not engine_lib.untie_applies(tcfg, tp)
    dcfg = tiny_drafter_config("dspark", tcfg, block_size=G)
    eng = ServingEngine(tcfg, dcfg, tp, drafters.init_params(dcfg, seed=1, target_params=tp), **KW)
    assert eng.tcfg is tcfg and eng.programs.tparams is tp


def test_the_engine_reads_the_targets_tables_for_the_drafters_frozen_copies():
    tcfg, tp, dcfg, dp = _tied()
    eng = ServingEngine(tcfg, dcfg, tp, dp, **KW)
    # the drafter's frozen copies are the target's arrays (the untied head's copy included)
    tparams, dparams = eng.programs.tparams, eng.programs.dparams
    assert dparams.frozen["lm_head"][...] is tparams["lm_head"]["kernel"][...]
    assert dparams.frozen["embed_tokens"][...] is tparams["embed_tokens"][...]
    leaves = eng.programs.params[1].leaves
    assert any(x is tparams["lm_head"]["kernel"][...] for x in leaves)
    # a drafter head that differs from the target's is kept; the trainable leaves are untouched
    other = dp.frozen["lm_head"][...].at[0, 0].add(1.0)
    frozen = jax.tree.map(lambda x: x, dp.frozen)
    frozen["lm_head"] = frozen["lm_head"].replace(other)
    dp2 = dp._replace(frozen=frozen)
    eng2 = ServingEngine(tcfg, dcfg, tp, dp2, **KW)
    assert eng2.programs.dparams.frozen["lm_head"][...] is other
    assert (
        eng2.programs.dparams.frozen["embed_tokens"][...]
        is eng2.programs.tparams["embed_tokens"][...]
    )
    assert eng2.programs.dparams.trainable is dp2.trainable
    # shared or not, the engine emits what plain decoding of the target emits
    p = PROMPTS[1]
    assert (
        eng.generate([p], max_new_tokens=16, temperature=0.0)[0].tokens
        == generate(tcfg, tp, [p], max_new_tokens=16)[0]
    )
