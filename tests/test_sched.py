"""Cost profile, prefix-scheduling policies (with hypothesis properties) and STS calibration."""

import ast
import itertools
import json
import pathlib
import sys
import time

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dspark_jax.sched import (
    STS,
    AsyncTopK,
    CausalGreedy,
    CostProfile,
    FixedGamma,
    StaticThreshold,
    causal_greedy_lengths,
    causal_greedy_reference,
    fit_sts,
    global_capacity,
    make_policy,
    survival,
    threshold_lengths,
    top_k_lengths,
)
from dspark_jax.spec.metrics import reliability_from_logits

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------------------------
# Strategies and references
# ------------------------------------------------------------------------------------------------

CONF_VALUES = st.one_of(
    st.sampled_from([0.0, 0.25, 0.5, 0.75, 0.9, 1.0]),  # exact ties
    st.floats(0.0, 1.0, allow_nan=False),
)


@st.composite
def confs(draw, max_r=4, max_g=4):
    r = draw(st.integers(1, max_r))
    g = draw(st.integers(1, max_g))
    return draw(hnp.arrays(np.float64, (r, g), elements=CONF_VALUES))


@st.composite
def costs(draw):
    """Arbitrary measured tables (not monotone), either layout, with or without buckets."""
    n = draw(st.integers(1, 6))
    tokens = sorted(draw(st.sets(st.integers(1, 40), min_size=n, max_size=n)))
    sps = draw(st.lists(st.floats(0.05, 10.0), min_size=n, max_size=n))
    layout = draw(st.sampled_from(["tokens", "padded"]))
    buckets = sorted(draw(st.sets(st.integers(1, 24), max_size=4)))
    if layout == "tokens":
        return CostProfile(tokens, sps, token_buckets=buckets)
    lengths = sorted(draw(st.sets(st.integers(0, 5), max_size=3)))
    return CostProfile(tokens, sps, layout="padded", batch_buckets=buckets, length_buckets=lengths)


def ranking(conf):
    """All (r, j) with survival > 0, by survival descending, ties: earlier slot, then request."""
    a = survival(conf)
    cands = [(-a[r, j], j, r) for r in range(a.shape[0]) for j in range(a.shape[1]) if a[r, j] > 0]
    return [(r, j) for _, j, r in sorted(cands)]


def admitted(lengths):
    return {(r, j) for r, n in enumerate(lengths) for j in range(n)}


def objective(conf, lengths, cost):
    a = survival(conf)
    tau = len(lengths) + sum(a[r, :n].sum() for r, n in enumerate(lengths))
    return tau * float(cost.sps_for(len(lengths), sum(lengths), max(lengths)))


def brute_force_best(conf, cost):
    r, g = conf.shape
    return max(objective(conf, ls, cost) for ls in itertools.product(range(g + 1), repeat=r))


# ------------------------------------------------------------------------------------------------
# CostProfile
# ------------------------------------------------------------------------------------------------


def test_cost_interpolates_step_time():
    cost = CostProfile((1, 5, 9), (10.0, 5.0, 2.0))  # step times 0.1, 0.2, 0.5
    np.testing.assert_allclose(cost.step_time([1, 3, 5, 7, 9]), [0.1, 0.15, 0.2, 0.35, 0.5])
    np.testing.assert_allclose(cost.step_time([0.5, 13]), [0.1, 0.8])  # clamp / extrapolate
    np.testing.assert_allclose(cost.sps([3, 0]), [1 / 0.15, 0.0])
    affine = CostProfile.from_step_time(0.01, 0.002, max_tokens=64)
    np.testing.assert_allclose(
        affine.sps([1, 10, 100]), 1 / (0.01 + 0.002 * np.array([1, 10, 100]))
    )


def test_cost_buckets_charge_what_the_engine_runs():
    cost = CostProfile((1, 64), (100.0, 50.0), token_buckets=(4, 8, 16))
    np.testing.assert_array_equal(cost.charged_tokens(2, [0, 2, 3, 14, 15], 0), [4, 4, 8, 16, 0])
    assert cost.sps_for(2, 15, 0) == 0.0  # beyond the largest bucket: cannot run
    padded = CostProfile(
        (1, 64), (100.0, 50.0), layout="padded", batch_buckets=(1, 4, 8), length_buckets=(0, 3, 7)
    )
    np.testing.assert_array_equal(
        padded.charged_tokens(3, 99, [0, 1, 3, 4, 7, 8]), [4, 16, 16, 32, 32, 0]
    )
    # The scheduler never schedules past the largest bucket.
    conf = np.ones((3, 10))
    assert causal_greedy_lengths(conf, padded).max() <= 7
    assert causal_greedy_lengths(conf, cost).sum() <= 16 - 3


def test_cost_json_round_trip(tmp_path):
    cost = CostProfile((1, 2, 4, 8), (90.0, 89.0, 85.0, 70.0), token_buckets=(2, 4, 8))
    path = tmp_path / "decode_cost.json"
    cost.save(path)
    assert CostProfile.load(path) == cost
    assert CostProfile.from_dict(json.loads(cost.to_json())) == cost
    raw = {
        "cost_profile": {
            "measurements": [
                {"batch": 1, "tokens_per_request": 4, "steps_per_s": 50.0},
                {"batch": 4, "tokens_per_request": 1, "steps_per_s": 25.0},
                {"batch": 1, "tokens_per_request": 1, "steps_per_s": 100.0},
            ],
            "meta": {"device": "cpu"},
        }
    }
    folded = CostProfile.from_dict(raw)
    assert folded.tokens == (1, 4)
    np.testing.assert_allclose(folded.steps_per_s, [100.0, 1 / np.mean([1 / 50, 1 / 25])])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=(2, 1), steps_per_s=(1.0, 1.0)), "increasing"),
        (dict(tokens=(1, 2), steps_per_s=(1.0,)), "equal length"),
        (dict(tokens=(1,), steps_per_s=(0.0,)), "> 0"),
        (dict(tokens=(1,), steps_per_s=(1.0,), layout="ragged"), "layout"),
        (dict(tokens=(1,), steps_per_s=(1.0,), token_buckets=(4, 2)), "token_buckets"),
        (dict(tokens=(1,), steps_per_s=(1.0,), batch_buckets=(4,)), "padded"),
    ],
)
def test_cost_rejects_bad_tables(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostProfile(**kwargs)


def test_cost_rejects_unknown_json_keys():
    with pytest.raises(ValueError, match="unknown"):
        CostProfile.from_dict({"cost_profile": {"tokens": [1], "steps_per_s": [1.0], "sps": 3}})


# ------------------------------------------------------------------------------------------------
# Policies
# ------------------------------------------------------------------------------------------------


def test_fixed_and_threshold():
    conf = np.array([[0.9, 0.4, 0.95], [0.2, 0.9, 0.9], [0.6, 0.6, 0.6]])
    np.testing.assert_array_equal(FixedGamma(2)(conf), [2, 2, 2])
    np.testing.assert_array_equal(FixedGamma(9)(conf, max_len=np.array([0, 1, 3])), [0, 1, 3])
    np.testing.assert_array_equal(StaticThreshold(0.5)(conf), [1, 0, 3])
    np.testing.assert_array_equal(StaticThreshold(0.0)(conf), [3, 3, 3])
    np.testing.assert_array_equal(
        StaticThreshold(0.0)(conf, max_len=np.array([1, 0, 2])), [1, 0, 2]
    )
    np.testing.assert_array_equal(threshold_lengths(conf, 0.95), [0, 0, 0])


def test_algorithm1_worked_example():
    cost = CostProfile((1, 2, 3, 4, 5), (1.0, 0.9, 0.8, 0.7, 0.6))
    conf = np.array([[0.9, 0.9], [0.5, 0.9]])
    # a = [[0.9, 0.81], [0.5, 0.45]]; Theta = tau* x SPS(2 + K):
    # 2 x 0.9 = 1.8 -> 2.9 x 0.8 = 2.32 -> 3.71 x 0.7 = 2.597 -> 4.21 x 0.6 = 2.526: stop.
    np.testing.assert_array_equal(CausalGreedy(cost)(conf), [2, 0])
    np.testing.assert_array_equal(causal_greedy_reference(conf, cost), [2, 0])


@PROPS
@given(confs(), costs())
def test_vectorised_greedy_equals_paper_loop(conf, cost):
    np.testing.assert_array_equal(
        causal_greedy_lengths(conf, cost), causal_greedy_reference(conf, cost)
    )


@PROPS
@given(confs(), costs(), st.integers(0, 20), st.data())
def test_lengths_are_prefixes_of_the_ranking(conf, cost, capacity, data):
    """Every policy's admitted set is prefix-closed per request, and for Algorithm 1 / top-K it
    is exactly the first sum(lengths) candidates of the survival ranking."""
    r, g = conf.shape
    max_len = data.draw(hnp.arrays(np.int64, (r,), elements=st.integers(0, g)))
    rank = ranking(np.where(np.arange(g) < max_len[:, None], conf, 0.0))
    for lengths in (
        causal_greedy_lengths(conf, cost, max_len),
        top_k_lengths(conf, capacity, max_len),
        AsyncTopK(cost)(conf, max_len=max_len, stale_conf=np.flip(conf, 0)),
        CausalGreedy(cost)(conf, max_len=max_len),  # with token buckets: the bucket fill too
    ):
        assert lengths.dtype == np.int32 and np.all((0 <= lengths) & (lengths <= max_len))
        assert admitted(lengths) == set(rank[: lengths.sum()])
    assert top_k_lengths(conf, capacity, max_len).sum() == min(capacity, len(rank))
    for lengths in (threshold_lengths(conf, 0.5, max_len), FixedGamma(2)(conf, max_len=max_len)):
        assert np.all((0 <= lengths) & (lengths <= max_len))


@st.composite
def convex_step_costs(draw, max_tokens):
    """Step time alpha + beta*B + kappa*max(0, B - B0): convex and non-decreasing."""
    alpha = draw(st.floats(0.05, 2.0))
    beta = draw(st.floats(0.0, 1.0))
    kappa = draw(st.floats(0.0, 2.0))
    b0 = draw(st.integers(1, max_tokens))
    tokens = np.arange(1, max_tokens + 1)
    step = alpha + beta * tokens + kappa * np.maximum(0, tokens - b0)
    return CostProfile(tuple(tokens), tuple(1.0 / step))


@PROPS
@given(st.data())
def test_greedy_reaches_brute_force_optimum_with_convex_step_time(data):
    """The condition is proved in sched/policies.py: convex, non-decreasing step time 1/SPS."""
    conf = data.draw(confs(max_r=3, max_g=3))
    r, g = conf.shape
    cost = data.draw(convex_step_costs(r * (g + 1)))
    got = objective(conf, causal_greedy_lengths(conf, cost), cost)
    assert got >= brute_force_best(conf, cost) * (1 - 1e-9)


def test_greedy_can_miss_the_optimum_at_a_bucket_cliff():
    """Merely monotone SPS is not enough (documented in sched/policies.py)."""
    cost = CostProfile((1, 2, 3), (1.0, 0.5, 0.5))
    conf = np.array([[0.9, 1.0]])
    assert list(causal_greedy_lengths(conf, cost)) == [0]
    assert objective(conf, [0], cost) == 1.0 and brute_force_best(conf, cost) == pytest.approx(1.4)


APPENDIX_A_COST = CostProfile((1, 2, 3), (1.0, 0.6, 0.55))


@PROPS
@given(confs(), costs(), st.integers(0, 20), st.integers(0, 2**32 - 1))
@example(np.array([[0.5, 0.9]]), APPENDIX_A_COST, 0, 0)
def test_admission_never_depends_on_the_tokens_own_value(conf, cost, capacity, seed):
    """Draft d_{r,j} only influences c_{r,j+1..}; re-drawing those (all 0, all 1, random) must
    not change whether (r, j) is admitted - for Algorithm 1, the asynchronous top-K admission
    (capacity from stale confidences) and the static threshold. Checked for every (r, j)."""
    rng = np.random.default_rng(seed)
    stale = rng.uniform(0, 1, conf.shape)
    policies = (
        lambda c: causal_greedy_lengths(c, cost),
        lambda c: top_k_lengths(c, capacity),
        lambda c: AsyncTopK(cost)(c, stale_conf=stale),
        lambda c: CausalGreedy(cost)(c),  # the engine's: with token buckets, the bucket fill
        lambda c: threshold_lengths(c, 0.5),
    )
    num_req, num_slots = conf.shape
    for r, j in itertools.product(range(num_req), range(num_slots)):
        variants = [conf]
        for tail in (0.0, 1.0, rng.uniform(0, 1, num_slots - j - 1)):
            other = conf.copy()
            other[r, j + 1 :] = tail
            variants.append(other)
        for policy in policies:
            assert len({bool(policy(c)[r] > j) for c in variants}) == 1, (r, j)


def test_retrospective_search_does_depend_on_the_tokens_own_value():
    """The same property fails for a global search on the current round (Appendix A)."""

    def retro(c):
        return top_k_lengths(c, global_capacity(c, APPENDIX_A_COST))

    assert retro(np.array([[0.5, 0.9]]))[0] > 0  # slot 0 admitted after d_0 = "good" token ...
    assert retro(np.array([[0.5, 0.1]]))[0] == 0  # ... and not after a "bad" one


def test_global_capacity_is_argmax():
    rng = np.random.default_rng(0)
    cost = CostProfile((1, 4, 8, 16, 40), (10.0, 9.5, 7.0, 6.5, 2.0))
    for _ in range(20):
        conf = rng.uniform(0, 1, (4, 5))
        rank = ranking(conf)
        a = survival(conf)
        theta = [
            (4 + sum(a[r, j] for r, j in rank[:k])) * float(cost.sps(4 + k))
            for k in range(len(rank) + 1)
        ]
        assert global_capacity(conf, cost) == int(np.argmax(theta))


def test_async_cold_start_and_capacity_source():
    cost = CostProfile.from_step_time(1.0, 0.1)
    conf = np.full((4, 3), 0.9)
    np.testing.assert_array_equal(AsyncTopK(cost, cold_start_gamma=2)(conf), [2, 2, 2, 2])
    low = AsyncTopK(cost)(conf, stale_conf=np.full((4, 3), 0.05))
    high = AsyncTopK(cost)(conf, stale_conf=np.full((4, 3), 0.99))
    assert low.sum() < high.sum()


def test_leading_batch_axes_equal_a_loop():
    rng = np.random.default_rng(1)
    cost = CostProfile.from_step_time(1.0, 0.08)
    conf = rng.uniform(0.2, 1.0, (5, 6, 4))
    stale = rng.uniform(0.2, 1.0, (5, 6, 4))
    for policy in (CausalGreedy(cost), AsyncTopK(cost), StaticThreshold(0.6), FixedGamma(3)):
        batched = policy(conf, stale_conf=stale)
        for i in range(5):
            np.testing.assert_array_equal(batched[i], policy(conf[i], stale_conf=stale[i]))


def test_make_policy_and_hashable():
    cost = CostProfile.from_step_time(1.0, 0.1)
    assert make_policy("dspark", cost=cost) == CausalGreedy(cost)
    assert hash(make_policy("async", cost=cost)) == hash(AsyncTopK(cost))
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("eagle")
    with pytest.raises(ValueError, match="theta"):
        StaticThreshold(1.5)


def test_scheduler_latency_r256_gamma7_under_1ms():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 1.0, (256, 7))
    cost = CostProfile(
        (1, 64, 256, 1024, 2048),
        (100.0, 95.0, 80.0, 40.0, 20.0),
        token_buckets=(256, 512, 1024, 2048),
    )
    for policy in (CausalGreedy(cost), AsyncTopK(cost)):
        policy(conf, stale_conf=conf)
        best = float("inf")
        for _ in range(30):
            t0 = time.perf_counter()
            policy(conf, stale_conf=conf)
            best = min(best, time.perf_counter() - t0)
        assert best < 1e-3, f"{type(policy).__name__}: {best * 1e6:.0f} us"


# ------------------------------------------------------------------------------------------------
# STS
# ------------------------------------------------------------------------------------------------


def synthetic_rounds(n, gamma, sharpen, offset, seed):
    """True conditional acceptance sigmoid(z); the model reports rho = sharpen * z + offset."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.2, 1.3, size=(n, gamma))
    accepted = rng.random((n, gamma)) < 1 / (1 + np.exp(-z))
    num_accepted = np.cumprod(accepted, axis=1).sum(1)
    return sharpen * z + offset, num_accepted, np.full(n, gamma)


def test_sts_cuts_ece_of_overconfident_scores_several_fold():
    rho, a, n = synthetic_rounds(40_000, 5, sharpen=2.5, offset=0.3, seed=0)
    sts = fit_sts(rho[:20_000], a[:20_000], n[:20_000])
    assert all(t > 1.5 for t in sts.temperatures)  # over-confident -> temperatures > 1
    before = reliability_from_logits(rho[20_000:], a[20_000:], n[20_000:])
    after = reliability_from_logits(
        rho[20_000:], a[20_000:], n[20_000:], temperatures=sts.temperatures
    )
    assert after.ece_summary * 4 < before.ece_summary, (before.ece, after.ece)
    assert all(x * 2 < y for x, y in zip(after.ece, before.ece))


def test_sts_keeps_calibrated_scores_and_rankings():
    rho, a, n = synthetic_rounds(20_000, 3, sharpen=1.0, offset=0.0, seed=1)
    sts = fit_sts(rho, a, n)
    assert all(0.8 < t < 1.25 for t in sts.temperatures), sts.temperatures
    sharp = STS((0.3, 2.0, 7.0))
    calibrated = sharp.probs(rho)
    for k in range(3):
        np.testing.assert_array_equal(
            np.argsort(calibrated[:, k], kind="stable"), np.argsort(rho[:, k], kind="stable")
        )


def test_sts_positions_without_data_and_serialisation(tmp_path):
    rho = np.array([[2.0, 1.0, 0.5], [1.0, -1.0, 0.0], [3.0, 2.0, 1.0]])
    sts = fit_sts(rho, np.array([1, 0, 1]), np.array([1, 1, 2]))
    assert sts.temperatures[2] == 1.0  # no round reached position 3
    sts.save(tmp_path / "sts.json")
    assert STS.load(tmp_path / "sts.json") == sts
    assert STS.from_dict({"other": 1, **sts.to_dict()}) == sts
    x = jnp.ones((2, 3), jnp.float32)
    assert isinstance(sts.apply(x), type(x)) and sts.apply(np.ones((2, 3))).shape == (2, 3)
    np.testing.assert_allclose(STS.identity(3).probs(np.zeros((1, 3))), 0.5)
    with pytest.raises(ValueError, match="refit"):
        STS((1.0, 1.0)).apply(np.ones((1, 3)))
    with pytest.raises(ValueError, match="> 0"):
        STS((1.0, -1.0))


def test_pure_packages_import_no_model_code():
    """spec/ and sched/ depend on jax, numpy, the standard library and the leaves io.py /
    errors.py / buckets.py / sampling_knobs.py (stdlib and numpy only) only
    (docs/ARCHITECTURE.md §2.11)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "dspark_jax"
    allowed = {"jax", "numpy"} | set(sys.stdlib_module_names)
    leaves = ("io", "errors", "buckets", "sampling_knobs")
    for leaf in leaves:  # the leaves themselves import only numpy and the standard library
        tree = ast.parse((root / f"{leaf}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                )
                assert all(
                    m.split(".")[0] in {"numpy"} | set(sys.stdlib_module_names) for m in mods
                ), f"{leaf}.py imports {mods}"
    for path in [*root.glob("spec/*.py"), *root.glob("sched/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                own = name.startswith(("dspark_jax.spec", "dspark_jax.sched"))
                own = own or name in {f"dspark_jax.{leaf}" for leaf in leaves}
                assert own or name.split(".")[0] in allowed, f"{path.name} imports {name}"
