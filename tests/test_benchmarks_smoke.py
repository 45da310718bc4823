"""Every benchmark runs at `--smoke` size: the same code path and the same JSON keys as a full
run, in seconds, so a library change that breaks a benchmark fails here rather than in the next
measurement session.

The benchmarks run in this process (their `main(argv)`, loaded from benchmarks/ as the installed
package's scripts): one jax import for all of them, and the programs one compiles are cached for
the next (the smoke runs share `testing.smoke_models`). `ab` goes last: its threefry experiment
clears jax's caches and turns on the unrolled threefry lowering for the process (the same bits,
tests/test_xla_cpu.py).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from dspark_jax.sched import CostProfile

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses in the script look their module up
    spec.loader.exec_module(mod)
    return mod


def _printed(text: str):
    """The last JSON object printed (a line starting with "{" through the end of the output)."""
    dec = json.JSONDecoder()
    lines = text.splitlines(keepends=True)
    for i in reversed(range(len(lines))):
        if lines[i].startswith("{"):
            rest = "".join(lines[i:])
            try:
                obj, end = dec.raw_decode(rest)
            except json.JSONDecodeError:
                continue
            if not rest[end:].strip():
                return obj
    raise AssertionError(f"no JSON object at the end of the output:\n{text[-2000:]}")


def _run(name: str, capsys, *argv: str) -> tuple[dict, dict]:
    """(main's return value as printed, the JSON it printed last)."""
    res = _load(name).main([*argv, "--smoke"])
    return json.loads(json.dumps(res, default=str)), _printed(capsys.readouterr().out)


def _keys_like(out: dict, full_run: str, *path: str) -> None:
    """`out` has the keys of the committed full run's results (at `path` inside both)."""
    full = json.loads((BENCHMARKS / "results" / full_run).read_text())
    for k in path:
        full, out = full[k], out[k]
    missing = set(full) - set(out)
    assert not missing, f"keys of results/{full_run} missing from the smoke run: {missing}"


def test_verify_and_schedule(capsys):
    res, printed = _run("verify_and_schedule", capsys)
    assert printed == res
    per_size = {
        f"{k}_B{b}_g2"
        for b in (1, 2)
        for k in ("verify_ms", "verify_tokens_per_s", "greedy_verify_ms", "sampled_over_greedy")
    }
    per_r = {f"sched_{k}_R{r}" for r in (1, 8)
             for k in ("us", "engine_us", "async_us", "threshold_us", "loop_us", "speedup")}  # fmt: skip
    assert per_size | per_r <= set(res)


def test_decode_cost(capsys, tmp_path):
    out = tmp_path / "cost.json"
    res, printed = _run("decode_cost", capsys, "--out", str(out))
    assert printed == res and res["out"] == str(out)
    assert set(res["layouts"]) == {"slots", "paged"} and "geomean" in res["paging_overhead"]
    assert all(v["retraces_after_warmup"] == 0 for v in res["layouts"].values())
    assert CostProfile.load(out).layout == "tokens"


def test_serving_frontier_sampled_with_a_measured_profile(capsys, tmp_path):
    """--temperature 1 and no cost profile: the frontier measures one on its engine
    (`eval.decode_cost.measure_profile`), the path that crashed with a run directory."""
    out = tmp_path / "frontier.json"
    res, printed = _run("serving_frontier", capsys, "--temperature", "1", "--out", str(out))
    assert printed == res["summary"] and json.loads(out.read_text()) == res
    assert set(res["results"]) == {"mtp1", "fixed3", "threshold", "alg1", "async"}
    assert all(len(points) == 2 for points in res["results"].values())  # concurrency 1, 2
    assert res["summary"]["retraces_after_warmup"] == 0
    _keys_like(res, "serving_frontier.tiny_run.json")
    _keys_like(res, "serving_frontier.tiny_run.json", "summary")


def test_kv_capacity(capsys):
    res, printed = _run("kv_capacity", capsys)
    assert printed == res
    s = res["summary"]
    assert s["batched_equals_serial"] and s["pages_leaked"] == 0 and s["retraces_after_warmup"] == 0
    _keys_like(res, "kv_capacity.cpu.json")


def test_round_loop(capsys, tmp_path):
    res, printed = _run("round_loop", capsys, "--out", str(tmp_path / "rl.json"))
    assert printed == res
    assert [b["retraces_after_warmup"] for b in res["batches"]] == [0]
    assert set(res["batches"][0]["round_ms"]) == {"1", "2"}
    _keys_like(res, "round_loop.json")


def test_train_step(capsys):
    res, printed = _run("train_step", capsys)
    assert printed == res and res["compiles_per_bucket"] == 1
    assert all(res[f"{k}_compiles"]["online_during_timed_steps"] == 0
               for k in ("dspark", "dflash", "eagle3"))  # fmt: skip
    _keys_like(res, "train_step.json")


def test_device_check(capsys, tmp_path):
    out = tmp_path / "device_check.json"
    res, printed = _run("device_check", capsys, "--out", str(out))
    assert printed == res == json.loads(out.read_text())
    assert res["reduced"] and "skipped" in res["parity"]
    assert all(row.get("greedy_equal", True) for row in res["serve"]["rows"])
    _keys_like(res, "device_check.h200.json")


def test_demo_proportions(capsys):
    res, printed = _run("demo_proportions", capsys)
    assert printed == res and set(res["targets"]) == {"smoke"}
    row = res["targets"]["smoke"]
    assert set(row["drafters"]) == {"dspark1L", "eagle3"} and "resident" in row
    _keys_like(res, "demo_proportions.s24.json")


def test_vs_transformers(capsys):
    pytest.importorskip("torch")
    res, printed = _run("vs_transformers", capsys)
    assert printed == res and set(res["results"]) == {"batch_1", "batch_2"}
    _keys_like(res, "vs_transformers.json")


@pytest.mark.parametrize("experiment", ["xla_cpu", "threefry"])
def test_ab(capsys, experiment):
    try:
        res, printed = _run("ab", capsys, experiment)
    except SystemExit as e:  # the setting does not apply on this machine: said in one line
        assert e.code == 1, e.code
        pytest.skip(capsys.readouterr().err.strip())
    assert printed == res and res["experiment"] == experiment and res["reps"] == 1
    assert set(res["speedup"]) == {k[: -len("_ms")] for k in res if k.endswith("_ms")
                                   and not k.startswith("replaced_")}  # fmt: skip
    if experiment == "threefry":
        assert all(res["same_output"].values())
