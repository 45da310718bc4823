"""`generate(..., loop="queue")` (continuous batching, `models.generate_queue`): the same tokens as
the static batches — greedy and sampled, rows finishing at different times (stop ids, budgets),
more prompts than rows — a row's work actually handed on (fewer steps), and no retrace when the
number of prompts changes within its bucket."""

import jax
import numpy as np
import pytest

from dspark_jax.models import transformer as tf
from dspark_jax.models.generate import _HostRows, generate
from dspark_jax.models.generate_queue import run_queue
from dspark_jax.spec.sampling import SamplingConfig
from dspark_jax.testing import CompileCounter, tiny_target_config

CFG = tiny_target_config(tie_word_embeddings=False)
LENGTHS = dict(length_buckets=(32, 64))
SCFG = SamplingConfig(top_k=True, top_p=True)
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(1, CFG.vocab_size, int(n)).tolist() for n in RNG.integers(1, 20, 11)]
MAX_NEW = [int(n) for n in RNG.integers(1, 24, 11)]


@pytest.fixture(scope="module")
def params():
    return tf.init_params(CFG, seed=1)


def _both(params, **kw):
    static = generate(CFG, params, PROMPTS, max_new_tokens=MAX_NEW, batch_buckets=(4,),
                      **LENGTHS, **kw)  # fmt: skip
    queued = generate(CFG, params, PROMPTS, max_new_tokens=MAX_NEW, batch_buckets=(3,),
                      loop="queue", **LENGTHS, **kw)  # fmt: skip
    return static, queued


def test_greedy_queue_equals_static_batches(params):
    static, queued = _both(params)
    assert queued == static
    assert [len(o) for o in queued] == MAX_NEW


def test_sampled_queue_equals_static_batches_with_stops(params):
    # frequent stop ids: rows end at different, sampled times
    stops = list(range(0, CFG.vocab_size, 23))
    kw = dict(sampling={"temperature": 1.0, "top_p": 0.95}, sampling_config=SCFG,
              seeds=list(range(100, 111)), stop_ids=stops)  # fmt: skip
    static, queued = _both(params, **kw)
    assert queued == static
    ended = [o[-1] in stops for o in queued]
    assert any(ended) and not all(ended)  # some stopped early, some ran to their budget


def test_rows_take_the_next_prompt(params):
    """3 rows through 11 prompts: the loop runs about sum(max_new) / 3 decode steps, where static
    batches of 3 would run the sum of each batch's longest budget."""
    n = len(PROMPTS)
    rows = _HostRows(np.array([len(p) for p in PROMPTS]), np.array(MAX_NEW),
                     np.arange(n, dtype=np.uint32), None)  # fmt: skip
    stop = np.full((4,), -1, np.int32)
    outs, steps = run_queue(CFG, params, PROMPTS, rows, stop, jax.random.key(0),
                            SamplingConfig(greedy=True), ((3,), (64,)))  # fmt: skip
    assert [len(o) for o in outs] == MAX_NEW
    static_steps = sum(max(MAX_NEW[i : i + 3]) - 1 for i in range(0, n, 3))
    assert steps <= -(-sum(MAX_NEW) // 3) + max(MAX_NEW)  # busy rows, one tail at the end
    assert steps < static_steps, (steps, static_steps)
    # one prompt with more rows than prompts: one row runs it
    one = generate(CFG, params, PROMPTS[:1], max_new_tokens=MAX_NEW[:1], batch_buckets=(3,),
                   loop="queue", **LENGTHS)  # fmt: skip
    assert one == outs[:1]


def test_no_retrace_when_the_number_of_prompts_changes(params):
    kw = dict(batch_buckets=(3,), loop="queue", **LENGTHS)
    generate(CFG, params, PROMPTS[:9], max_new_tokens=MAX_NEW[:9], **kw)  # queue bucket 16
    with CompileCounter() as cc:
        generate(CFG, params, PROMPTS[:10], max_new_tokens=MAX_NEW[:10], **kw)
        generate(CFG, params, PROMPTS[:11], max_new_tokens=MAX_NEW[:11], **kw)
    assert cc.count == 0
