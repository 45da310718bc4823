"""The training steps' XLA:CPU option: given only where it applies, accepted by the installed
jaxlib with the same results, and wired into the target's and the drafter trainer's steps; the
unrolled threefry lowering: the same bits, given only where it applies."""

import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.runtime import xla_cpu
from dspark_jax.train import lm, steps

BAD = {xla_cpu.OPTION: "NOT_A_FUSION_TYPE"}  # XLA rejects it at compile time


def test_given_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(xla_cpu, "_jaxlib_release", lambda: xla_cpu.CHECKED_JAXLIB[0])
    assert xla_cpu.training_compiler_options({}) == {xla_cpu.OPTION: xla_cpu.VALUE}
    assert xla_cpu.training_compiler_options({"XLA_FLAGS": "--xla_cpu_use_xnnpack=true"})
    # the user's own setting of the option wins, and the switch turns it off
    users = {"XLA_FLAGS": f"--{xla_cpu.OPTION}=dot"}
    assert xla_cpu.training_compiler_options(users) is None
    assert xla_cpu.training_compiler_options({xla_cpu.ENV: "off"}) is None
    # the engine's: no YNNPACK fusion, under the same conditions
    assert xla_cpu.engine_compiler_options({}) == {xla_cpu.OPTION: ""}
    assert xla_cpu.engine_compiler_options(users) is None
    assert xla_cpu.engine_compiler_options({xla_cpu.ENV: "off"}) is None
    for release in [(0, 6), (1, 0), None]:  # releases it was not checked on
        monkeypatch.setattr(xla_cpu, "_jaxlib_release", lambda r=release: r)
        assert xla_cpu.training_compiler_options({}) is None
        assert xla_cpu.engine_compiler_options({}) is None


def test_the_installed_jaxlib_compiles_with_it_and_computes_the_same():
    if xla_cpu._jaxlib_release() not in xla_cpu.CHECKED_JAXLIB:
        pytest.skip("jaxlib release the option was not checked on")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 96)), jnp.float32)

    def f(x):
        return jax.nn.log_softmax(x @ x.T, -1).sum(-1) + jnp.abs(jnp.exp(x)).max(-1)[:64]

    low = jax.jit(f).lower(x)
    want = low.compile()(x)
    for value in (xla_cpu.VALUE, xla_cpu.ENGINE_VALUE):
        got = low.compile({xla_cpu.OPTION: value})(x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(Exception, match="valid enum|NOT_A_FUSION_TYPE"):
        low.compile(BAD)


def test_the_training_steps_are_compiled_with_it(monkeypatch, tmp_path):
    """A rejected option makes exactly the programs that carry it fail: the target's training
    step and the drafter trainer's steps do; a decoding program does not."""
    monkeypatch.setattr(steps, "training_compiler_options", lambda: BAD)
    monkeypatch.setattr(lm, "training_compiler_options", lambda: BAD)
    step = steps.jitted(lambda x: x * 2.0, (), (), None)
    with pytest.raises(Exception, match="valid enum|NOT_A_FUSION_TYPE"):
        step(jnp.ones(3))
    from dspark_jax.config import TrainConfig
    from dspark_jax.models.generate import generate
    from dspark_jax.models.transformer import init_params
    from dspark_jax.testing import tiny_target_config

    cfg = tiny_target_config()
    tc = TrainConfig(total_steps=1, global_batch_size=2, micro_batch_size=2, seq_buckets=(16,))
    with pytest.raises(Exception, match="valid enum|NOT_A_FUSION_TYPE"):
        lm.train_lm(cfg, [list(range(1, 60))], tc, tmp_path / "lm", progress=False)
    out = generate(cfg, init_params(cfg, 0), [[1, 2, 3]], max_new_tokens=2)  # default options
    assert len(out[0]) == 2


def test_batch1_plain_decoding_is_compiled_with_it_and_batches_are_not(monkeypatch):
    """`generate` at batch bucket 1 carries the option (its cache updates stay in place,
    xla_cpu.py); a batch of two keeps XLA's default."""
    from dspark_jax.models import generate as gen
    from dspark_jax.models.transformer import init_params
    from dspark_jax.testing import tiny_target_config

    cfg = tiny_target_config()
    params = init_params(cfg, 0)
    monkeypatch.setattr(gen, "batch1_decode_compiler_options", lambda: BAD)
    with pytest.raises(Exception, match="valid enum|NOT_A_FUSION_TYPE"):
        gen.generate(cfg, params, [[1, 2, 3]], max_new_tokens=2, batch_buckets=(1, 2))
    out = gen.generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=2, batch_buckets=(1, 2))
    assert [len(o) for o in out] == [2, 2]
    if xla_cpu._jaxlib_release() in xla_cpu.CHECKED_JAXLIB:  # the real option: the same tokens
        monkeypatch.setattr(gen, "batch1_decode_compiler_options", lambda: None)
        want = gen.generate(cfg, params, [[1, 2, 3]], max_new_tokens=12)
        monkeypatch.setattr(
            gen, "batch1_decode_compiler_options", xla_cpu.training_compiler_options
        )
        assert gen.generate(cfg, params, [[1, 2, 3]], max_new_tokens=12) == want


def test_batch1_prefill_is_compiled_with_the_engines_option_and_batches_are_not(monkeypatch):
    """At batch 1 `generate` prefills in its own program with the engine's option; a batch of
    two is one program with XLA's default."""
    from dspark_jax.models import generate as gen
    from dspark_jax.models.transformer import init_params
    from dspark_jax.testing import tiny_target_config

    cfg = tiny_target_config()
    params = init_params(cfg, 0)
    want = gen.generate(cfg, params, [[1, 2, 3]], max_new_tokens=12)
    monkeypatch.setattr(gen, "engine_compiler_options", lambda: BAD)
    with pytest.raises(Exception, match="valid enum|NOT_A_FUSION_TYPE"):
        gen.generate(cfg, params, [[1, 2, 3]], max_new_tokens=2, batch_buckets=(1, 2))
    out = gen.generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=2, batch_buckets=(1, 2))
    assert [len(o) for o in out] == [2, 2]
    # neither option (another backend, turned off): one program, the same tokens
    monkeypatch.setattr(gen, "engine_compiler_options", lambda: None)
    monkeypatch.setattr(gen, "batch1_decode_compiler_options", lambda: None)
    assert gen._batch1_programs() is None
    assert gen.generate(cfg, params, [[1, 2, 3]], max_new_tokens=12) == want


def test_the_serving_engines_programs_are_compiled_with_its_option(monkeypatch, caplog):
    """Prefill, one-round and K-round programs of a ServingEngine carry the engine's option (a
    rejected one fails each of them: the request ends with a device error, the log names XLA's
    complaint), and with the real one greedy output is plain greedy's."""
    from dspark_jax.engine import ServingEngine
    from dspark_jax.engine import programs as programs_lib
    from dspark_jax.models.generate import generate
    from tests.engine_models import agreeing_pair

    tcfg, tp, dcfg, dp = agreeing_pair(vocab=64, gamma=4)

    def engine(k):
        return ServingEngine(tcfg, dcfg, tp, dp, num_slots=1, max_len=48, prompt_buckets=(8,),
                             token_buckets=(5,), modes=("greedy",), rounds_per_call=k)  # fmt: skip

    def run(eng, prompt, n):
        return eng.generate([prompt], max_new_tokens=n, temperature=0.0)[0]

    def rejected(out):
        bad = re.search("valid enum|NOT_A_FUSION_TYPE", caplog.text)
        caplog.clear()
        return out.finish_reason == "error" and "device failed" in out.error and bool(bad)

    real = programs_lib.engine_compiler_options()
    monkeypatch.setattr(programs_lib, "engine_compiler_options", lambda: BAD)
    caplog.set_level(logging.ERROR, logger="dspark_jax.engine.engine")
    out = run(engine(1), [3, 9, 1], 12)  # fails in prefill
    assert rejected(out) and out.tokens == []
    for k in (1, 4):  # with a prefill that compiles, in the one-round / K-round program
        # the option is read per program, prefill first: the real one for it only
        options = iter([real, BAD, BAD])
        monkeypatch.setattr(
            programs_lib, "engine_compiler_options", lambda options=options: next(options)
        )
        assert rejected(run(engine(k), [3, 9, 1], 12))
    monkeypatch.setattr(programs_lib, "engine_compiler_options", lambda: real)
    for k in (1, 4):
        assert (
            run(engine(k), [3, 9, 1], 12).tokens
            == generate(tcfg, tp, [[3, 9, 1]], max_new_tokens=12)[0]
        )


_THREEFRY_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from dspark_jax.runtime import xla_cpu
from dspark_jax.spec import sampling as S

def draws():
    key = jax.random.key(7)
    keys = jax.random.split(key, 5)
    f = jax.jit(lambda k, ks: (
        jax.random.bits(k, (37, 3)), jax.random.uniform(k, (1000,)), S.gumbel_noise(ks, 300),
        jax.random.categorical(jax.random.fold_in(k, 3), jnp.zeros((4, 50))),
        jax.random.key_data(jax.random.split(k, 3))))
    text = jax.jit(lambda k: jax.random.bits(k, (64,))).lower(key).as_text()
    return [np.asarray(x).tolist() for x in f(key, keys)], "while" in text

before, rolled_loop = draws()
jax.clear_caches()
on = xla_cpu.unrolled_threefry({})
after, unrolled_loop = draws()
print(json.dumps(dict(on=on, same=before == after, rolled_loop=rolled_loop,
                      unrolled_loop=unrolled_loop, again=xla_cpu.unrolled_threefry({}))))
"""


def test_unrolled_threefry_draws_the_same_bits_without_a_loop():
    """In a fresh process (the lowering is process-wide): every kind of draw the project makes
    is bit for bit the same after the switch, and the lowered hash has lost its rolled loop."""
    import json
    import subprocess
    import sys

    if xla_cpu._release("jax") not in xla_cpu.THREEFRY_CHECKED_JAX:
        pytest.skip("jax release the unrolled lowering was not checked on")
    out = subprocess.run([sys.executable, "-c", _THREEFRY_SCRIPT], capture_output=True,
                         text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == dict(on=True, same=True, rolled_loop=True, unrolled_loop=False, again=True)


def test_unrolled_threefry_is_not_given_where_it_does_not_apply(monkeypatch):
    monkeypatch.setattr(xla_cpu, "_threefry_on", False)
    assert xla_cpu.unrolled_threefry({xla_cpu.THREEFRY_ENV: "off"}) is False
    monkeypatch.setattr(xla_cpu, "_release", lambda package: (0, 4))
    assert xla_cpu.unrolled_threefry({}) is False
