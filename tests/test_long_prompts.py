"""Prompts up to the target's context: `generate` whatever its length buckets, the engine on both
KV layouts (chunked prefill), the HTTP server and the evaluator's prompt limit accept them; one
token more is refused before any work with one line naming the context and the fix."""

from __future__ import annotations

import httpx
import pytest

from dspark_jax import drafters
from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.engine.config import EngineConfig
from dspark_jax.errors import RequestError
from dspark_jax.models.generate import generate
from dspark_jax.run.rundir import RunDir
from dspark_jax.server.app import create_app
from dspark_jax.server.run import serve_in_thread
from dspark_jax.testing import (
    random_params,
    tiny_drafter_config,
    tiny_target_config,
    tiny_tokenizer,
)
from tests.engine_models import agreeing_pair
from tests.test_server_cli import _fake_run, ckpts  # noqa: F401  (the fixture)

G = 4
CTX = 160  # the target's context in these tests (not a power of two, not a length bucket)
NEW = 12


@pytest.fixture(scope="module")
def pair():
    return agreeing_pair(vocab=64, gamma=G, max_position_embeddings=CTX)


def _long_prompt(n, seed=0):
    return [(7 * i + seed) % 60 + 1 for i in range(n)]


@pytest.fixture(scope="module")
def ref(pair):
    tcfg, tp, _, _ = pair
    return generate(tcfg, tp, [_long_prompt(CTX - NEW)], max_new_tokens=NEW)[0]


def test_generate_accepts_the_context_with_its_default_buckets(pair, ref):
    tcfg, tp, _, _ = pair
    # the default buckets end at the context (160, not a power of two)
    assert len(ref) == NEW
    got = generate(tcfg, tp, [_long_prompt(CTX - NEW)], max_new_tokens=NEW, length_buckets=(CTX,))
    assert got == [ref]
    with pytest.raises(RequestError, match=f"context of {CTX} tokens.*<= {NEW - 1}") as e:
        generate(tcfg, tp, [_long_prompt(CTX - NEW + 1)], max_new_tokens=NEW)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_engine_serves_a_prompt_of_the_whole_context(pair, ref, layout):
    tcfg, tp, dcfg, dp = pair
    eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=2, max_len=EngineConfig.max_len_for(CTX, G),
                        prompt_buckets=(16, 64), modes=("greedy",), kv_layout=layout,
                        page_size=8, prefill_tokens_per_step=64)  # fmt: skip
    assert eng.token_limit == CTX
    short = eng.submit([3, 9, 1], RequestParams(20, temperature=0.0))
    long = eng.submit(_long_prompt(CTX - NEW), RequestParams(NEW, temperature=0.0))
    while eng.has_work():
        eng.step()
    assert long.result().tokens == ref
    assert short.result().tokens == generate(tcfg, tp, [[3, 9, 1]], max_new_tokens=20)[0]
    with pytest.raises(RequestError, match=f"target's context of {CTX} tokens") as e:
        eng.submit(_long_prompt(CTX - NEW + 1), RequestParams(NEW, temperature=0.0))
    assert "\n" not in str(e.value)


def test_engine_below_the_context_names_its_limit_and_the_fix(pair):
    tcfg, tp, dcfg, dp = pair
    eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=1, max_len=64, prompt_buckets=(16,))
    with pytest.raises(RequestError, match=r"limit of 59 tokens.*max_len up to 165") as e:
        eng.submit(_long_prompt(60), RequestParams(4, temperature=0.0))
    assert "\n" not in str(e.value)


def test_server_accepts_the_context_and_refuses_one_token_more(tmp_path_factory):
    tok = tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")
    tcfg = tiny_target_config(vocab_size=512, max_position_embeddings=CTX)
    tp = random_params(tcfg, 0)
    dcfg = tiny_drafter_config("dflash", tcfg, mask_token_id=3)
    dp = drafters.init_params(dcfg, target_params=tp)
    eng = ServingEngine(tcfg, dcfg, tp, dp, num_slots=1, max_len=EngineConfig.max_len_for(CTX, 4),
                        prompt_buckets=(64,), modes=("greedy",), kv_layout="paged", page_size=16)  # fmt: skip
    server, thread, port = serve_in_thread(create_app(eng, tok, "m", stop_ids=()))
    url = f"http://127.0.0.1:{port}"
    try:
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        assert models["max_model_len"] == CTX
        body = {"model": "m", "prompt": _long_prompt(CTX - 4), "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        r = httpx.post(url + "/v1/completions", json=body | {"prompt": _long_prompt(CTX)},
                       timeout=30)  # fmt: skip
        assert r.status_code == 400 and f"maximum context length is {CTX}" in r.text
        r = httpx.post(url + "/v1/completions", json=body | {"max_tokens": 5}, timeout=30)
        assert r.status_code == 400 and "lower max_tokens to <= 4" in r.text
    finally:
        server.should_exit = True
        thread.join(60)


def test_evaluator_limit_is_the_context_less_the_generation_budget(ckpts, tmp_path):  # noqa: F811
    target, _ = ckpts
    _fake_run(tmp_path / "run", target)
    run = RunDir(tmp_path / "run")
    ctx = run.context_len()
    assert run.prompt_limit(16) == ctx - 16
    assert run.prompt_limit(16, cap=300) == 300 - 16
    dec = run.decoder_for("dspark", [ctx - 16], 16, num_slots=1, lean=True)
    dec.submit(list(range(5, 5 + ctx - 16)), RequestParams(16, temperature=0.0))  # accepted
    with pytest.raises(RequestError, match="does not fit the target's context"):
        run.decoder_for("dspark", [ctx - 15], 16, num_slots=1)
