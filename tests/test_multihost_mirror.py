"""`engine.multihost.Mirror` in one process: a leader engine and a follower engine joined by a
channel that hands the leader's per-step message to the follower (what the broadcast does across
processes). Arrivals mid-flight, a cancellation, a request failed on the host and a stop: the
follower's requests, slots and tokens stay those of the leader, step for step."""

from __future__ import annotations

import collections

import pytest

from dspark_jax.engine import RequestParams, ServingEngine
from dspark_jax.engine.multihost import Mirror
from tests.engine_models import agreeing_pair

KW = dict(num_slots=2, max_len=64, prompt_buckets=(8, 16), token_buckets=(4, 10),
          cache_buckets=(64,), modes=("greedy", "sampled", "filtered"))  # fmt: skip


@pytest.fixture(scope="module")
def pair():
    return agreeing_pair(vocab=64, gamma=4)


def test_follower_engine_stays_in_lockstep_with_the_leader(pair):
    tcfg, tp, dcfg, dp = pair
    lead, follow = ServingEngine(tcfg, dcfg, tp, dp, **KW), ServingEngine(tcfg, dcfg, tp, dp, **KW)
    wire = collections.deque()

    def send(msg):
        wire.append(msg)
        return msg

    Mirror(lead, leader=True, channel=send)
    Mirror(follow, leader=False, channel=lambda _: wire.popleft())
    mirrored = {}  # the follower's handles, by request id
    submit = follow.submit

    def recording_submit(prompt, params):
        h = submit(prompt, params)
        mirrored[h.id] = h
        return h

    follow.submit = recording_submit
    arrivals = {0: [([3, 9, 1], RequestParams(20, temperature=0.0))],
                1: [([5, 6, 7], RequestParams(16, temperature=0.9, top_p=0.9))],  # seed drawn
                2: [([40, 41, 42, 43], RequestParams(30, temperature=0.0)),
                    ([1, 2], RequestParams(12, temperature=1.0, seed=5))]}  # fmt: skip
    owners = lambda eng: [None if r is None else r.id for r in eng.slots.owner]  # noqa: E731
    handles, step = [], 0
    while step < 5 or lead.has_work():
        for prompt, params in arrivals.get(step, []):
            handles.append(lead.submit(prompt, params))
        if step == 3:
            lead.cancel(handles[2].id)
        if step == 4:
            lead.fail(handles[3].id, "detokenize", "test")
        lead.step()
        follow.step()
        assert owners(follow) == owners(lead), step
        step += 1
    assert not follow.has_work() and not wire
    for h in handles:
        mine, theirs = h.result(), mirrored[h.id].result()
        assert (
            list(theirs.tokens) == list(mine.tokens) and theirs.finish_reason == mine.finish_reason
        )
    assert [h.result().finish_reason for h in handles][2:] == ["cancelled", "error"]
    assert len(handles[1].result().tokens) == 16  # sampled with the seed the leader drew
    # the leader's stop message ends the follower's loop
    lead.mirror.stop()
    follow.mirror.follow()
    assert follow.mirror_stopped
