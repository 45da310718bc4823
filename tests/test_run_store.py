"""The run directory never destroys trained work: exact stage keys, outputs built aside and
swapped in, replaced outputs kept (and restored), bounded versions, validation before any stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_jax.config.pipeline import apply_overrides
from dspark_jax.errors import ConfigError, DataError
from dspark_jax.run.pipeline import STAGES, Pipeline
from dspark_jax.run.store import StageStore

ROOT = Path(__file__).resolve().parents[1]


def _micro(tmp_path, *sets):
    import runpy

    cfg = runpy.run_path(str(ROOT / "configs" / "micro.py"))["config"]()
    return apply_overrides(cfg, [f"run_dir={tmp_path / 'run'}", *sets])


def _prompts(path: Path, turns: list[str]) -> str:
    path.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in turns))
    return str(path)


def _keys(tmp_path, *sets) -> dict[str, str]:
    p = Pipeline(_micro(tmp_path, *sets), log=lambda *_: None)
    return {s: p.key(s) for s in STAGES}


def _changed(a: dict, b: dict) -> set[str]:
    return {s for s in STAGES if a[s] != b[s]}


def test_eval_prompts_change_evaluate_only(tmp_path):
    f1 = _prompts(tmp_path / "gsm.jsonl", ["What is 1 plus 2?", "Name a color."])
    f2 = _prompts(tmp_path / "other.jsonl", ["Write a haiku."])
    base = _keys(tmp_path)
    one = _keys(tmp_path, f"data.eval_prompt_files={f1}")
    two = _keys(tmp_path, f"data.eval_prompt_files={f1},{f2}")
    assert _changed(base, one) == {"evaluate"}
    assert _changed(one, two) == {"evaluate"}
    # the file's content is hashed, not only its path
    _prompts(tmp_path / "gsm.jsonl", ["What is 1 plus 3?", "Name a color."])
    assert _changed(one, _keys(tmp_path, f"data.eval_prompt_files={f1}")) == {"evaluate"}


def test_eval_temperature_changes_calibrate_and_evaluate(tmp_path):
    base = _keys(tmp_path)
    assert _changed(base, _keys(tmp_path, "evaluate.temperature=0.5")) == {"calibrate", "evaluate"}
    assert _changed(base, _keys(tmp_path, "evaluate.batch_size=2")) == {"calibrate", "evaluate"}
    # fields only evaluate reads
    assert _changed(base, _keys(tmp_path, "evaluate.speed_prompts=0")) == {"evaluate"}
    assert _changed(base, _keys(tmp_path, "name=other")) == {"evaluate"}


def test_upstream_changes_propagate_and_bookkeeping_fields_do_not(tmp_path):
    base = _keys(tmp_path)
    later = {"drafters", "calibrate", "evaluate"}
    assert _changed(base, _keys(tmp_path, "drafters.train.total_steps=4")) == later
    # calibrate.max_prompts sets the regeneration split
    assert _changed(base, _keys(tmp_path, "calibrate.max_prompts=5")) == {"regenerate", *later}
    assert _changed(base, _keys(tmp_path, "target.train.total_steps=3")) == {
        "target",
        "regenerate",
        *later,
    }
    assert _changed(base, _keys(tmp_path, "keep_versions=1")) == set()
    assert _changed(base, _keys(tmp_path / "elsewhere")) == set()  # run_dir is not an input


def _commit(store: StageStore, stage: str, key: str, payload: str):
    w = store.begin(stage, key, force=False)
    (w / "weights.txt").write_text(payload)
    store.commit(stage, key, {}, force=False)


def test_store_keeps_restores_and_bounds_versions(tmp_path):
    logs = []
    store = StageStore(tmp_path, keep=2, log=logs.append)
    _commit(store, "drafters", "aaaa", "A")
    _commit(store, "drafters", "bbbb", "B")
    assert (tmp_path / "drafters" / "weights.txt").read_text() == "B"
    assert (tmp_path / "previous" / "drafters.aaaa" / "weights.txt").read_text() == "A"
    assert any("kept the previous output in previous/drafters.aaaa" in m for m in logs)
    # the old configuration comes back: restored, not retrained; B is kept aside
    assert store.recover("drafters", "aaaa")
    assert (tmp_path / "drafters" / "weights.txt").read_text() == "A"
    assert (tmp_path / "previous" / "drafters.bbbb" / "weights.txt").read_text() == "B"
    for k in ("cccc", "dddd", "eeee"):
        _commit(store, "drafters", k, k)
    assert len(list((tmp_path / "previous").glob("drafters.*"))) == 2
    assert any("removed previous/drafters." in m for m in logs)


def test_failed_build_leaves_current_output_and_resumes(tmp_path):
    store = StageStore(tmp_path, keep=3, log=lambda *_: None)
    _commit(store, "evaluate", "aaaa", "report A")
    w = store.begin("evaluate", "bbbb", force=False)
    (w / "partial.txt").write_text("half")  # ... and the stage fails here
    assert (tmp_path / "evaluate" / "weights.txt").read_text() == "report A"
    assert store.is_done("evaluate", "aaaa") and not store.is_done("evaluate", "bbbb")
    assert (store.begin("evaluate", "bbbb", force=False) / "partial.txt").exists()  # resumed
    assert not (store.begin("evaluate", "bbbb", force=True) / "partial.txt").exists()


def test_force_moves_trained_weights_but_discards_other_outputs(tmp_path):
    store = StageStore(tmp_path, keep=3, log=lambda *_: None)
    for stage in ("target", "calibrate"):
        _commit(store, stage, "aaaa", "old")
        w = store.begin(stage, "aaaa", force=True)
        (w / "weights.txt").write_text("new")
        store.commit(stage, "aaaa", {}, force=True)
        assert (tmp_path / stage / "weights.txt").read_text() == "new"
    kept = list((tmp_path / "previous").glob("target.aaaa.forced-*"))
    assert len(kept) == 1 and (kept[0] / "weights.txt").read_text() == "old"
    assert not list((tmp_path / "previous").glob("calibrate.*"))


def test_pipeline_changed_stage_keeps_previous_output(tmp_path):
    logs = []
    cfg = _micro(tmp_path, "data.corpus.n_math=20")
    Pipeline(cfg, log=logs.append).run_stages(("corpus",))
    first = Pipeline(cfg, log=logs.append).key("corpus")
    cfg2 = apply_overrides(cfg, ["data.corpus.n_math=30"])
    p2 = Pipeline(cfg2, log=logs.append)
    assert p2.run_stages(("corpus",)) == {"corpus": "ran"}
    assert (tmp_path / "run" / "previous" / f"corpus.{first}" / "done.json").exists()
    assert any("changed: data.corpus" in m for m in logs)
    # back to the first configuration: restored, not rebuilt
    assert Pipeline(cfg, log=logs.append).run_stages(("corpus",)) == {"corpus": "cached"}
    assert any("restored the output of this configuration" in m for m in logs)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["corpus"]["n_math"] == 20


def test_missing_upstream_is_an_error_before_anything_runs(tmp_path):
    cfg = _micro(tmp_path)
    with pytest.raises(ConfigError, match="drafters, calibrate have no output"):
        Pipeline(cfg, log=lambda *_: None).run_stages(("evaluate",))
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.parametrize(
    "override, match",
    [
        ("evaluate.temperature=-1", r"evaluate.temperature=-1.0 is out of range"),
        ("drafters.markov_head_type=gatd", "markov_head_type='gatd' is unknown"),
        ("drafters.kinds=dspark,medusa", "unknown drafter kind 'medusa'"),
        ("regenerate.top_p=0", "regenerate.top_p=0.0 is out of range"),
        ("drafters.train.total_steps=0", "drafters.train.total_steps=0 is out of range"),
        ("drafters.lr=0.1", "unknown config key 'drafters.lr'"),
        ("evaluate.max_new_tokens=5000", "leaves -"),
        ("evaluate.max_len=4096", "exceeds the target's context"),
        ("data.eval_prompt_files=/nonexistent/p.jsonl", "does not exist"),
    ],
)
def test_bad_config_fails_at_start(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        Pipeline(_micro(tmp_path, override), log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_bad_input_files_fail_at_start(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": "not a list"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        Pipeline(_micro(tmp_path, f"data.eval_prompt_files={bad}"), log=lambda *_: None)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        Pipeline(_micro(tmp_path, f"data.eval_prompt_files={empty}"), log=lambda *_: None)
    conv = tmp_path / "conv.jsonl"
    conv.write_text('{"conversations": [{"role": "user"}]}\n')
    with pytest.raises(DataError):
        Pipeline(_micro(tmp_path, f"data.conversation_files={conv}"), log=lambda *_: None)
    assert not (tmp_path / "run").exists()
