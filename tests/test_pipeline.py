"""train.py end to end: the micro preset (same code path as the demo) and the real-target preset
on a tiny random Hugging Face checkpoint. Both check the report and that reruns resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.config import TargetConfig
from dspark_jax.config.pipeline import PipelineConfig, apply_overrides
from dspark_jax.errors import ConfigError
from dspark_jax.run.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]


def _run(args, timeout=600, devices=1):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one device, like a user's run
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["TQDM_DISABLE"] = "1"
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _check_report(run_dir: Path, kinds=("dspark", "dflash", "eagle3")):
    rep = json.loads((run_dir / "evaluate" / "report.json").read_text())
    assert set(rep["tau"]) == set(kinds)
    for k in kinds:
        row = rep["tau"][k]
        assert row["macro"] >= 1.0
        assert set(row["datasets"]) == set(rep["datasets"])
        for v in rep["per_dataset"][k].values():
            assert v["rounds"] > 0 and 1.0 <= v["tau"]
            assert len(v["conditional_acceptance"]) == len(v["prefix_survival"])
    if "dflash" in kinds:
        assert "dspark_vs_dflash" in rep["relative_macro_gain"]
    assert rep["calibration"] is not None and len(rep["calibration"]["per_position"]) >= 1
    assert rep["speed_batch1"]["speedup"] > 0
    assert rep["speed_batch1"]["slots"] == 1 and rep["speed_batch1"]["rounds_per_call"] == 16
    assert (run_dir / "evaluate" / "report.md").read_text().startswith("# dspark-jax evaluation")
    assert (run_dir / "evaluate" / "tau.png").stat().st_size > 1000
    return rep


@pytest.fixture
def first_micro_run(micro_run, tmp_path) -> tuple[Path, str]:
    """A copy of the session's micro run from an empty run directory (tests/conftest.py's
    `micro_run`: CI's first step's run, else trained once) and train.py's output of it."""
    run_dir = tmp_path / "micro"
    shutil.copytree(micro_run[0], run_dir)  # a copy: the checks below change it
    return run_dir, micro_run[1]


@pytest.mark.slow
def test_micro_pipeline_end_to_end_and_resume(first_micro_run, tmp_path):
    run_dir, out = first_micro_run
    assert "| drafter |" in out
    # the overall progress line before every stage, and the whole run's time at the end
    assert out.count("[pipeline] ") == 8 and "min left in all" in out
    assert "[pipeline] evaluate (7/7)" in out and "[pipeline] done in" in out
    # calibrate's and evaluate's decoders print their memory plan per device before decoding
    assert "dspark decoder (" in out and "engine memory per device: params" in out
    _check_report(run_dir)
    # the pipeline's decoders are lean: one prompt bucket, two token buckets (slots x (γ+1), half)
    from dspark_jax.run.rundir import RunDir

    rd = RunDir(run_dir)
    dec, plain = (rd.decoder_for("dspark", [200], 16, lean=x) for x in (True, False))
    full = max(1, rd.config.evaluate.batch_size) * (rd.config.drafters.block_size + 1)
    assert dec.prompt_buckets == (256,) and dec.token_buckets == (full // 2, full)
    assert len(plain.prompt_buckets) > 1 and len(plain.token_buckets) > 2
    mtimes = {p: p.stat().st_mtime for p in run_dir.rglob("done.json")}
    assert len(mtimes) == 7
    # the preset's drafters read one shared offline feature cache, not kept with their output
    assert "shared by the drafters" in out and not (run_dir / "drafters" / "features").exists()
    out2 = _run(["--config", "configs/micro.py", "--run-dir", str(run_dir)])
    expected = (
        "corpus: cached, tokenizer: cached, target: cached, regenerate: cached, "
        "drafters: cached, calibrate: cached, evaluate: cached"
    )
    assert expected in out2
    assert all(p.stat().st_mtime == t for p, t in mtimes.items())
    # a changed drafter setting redoes drafters and what follows, nothing before
    out3 = _run(
        ["--config", "configs/micro.py", "--run-dir", str(run_dir), "--set", "drafters.train.total_steps=4",
         "--stages", "corpus,tokenizer,target,regenerate,drafters"]
    )  # fmt: skip
    assert "target: cached" in out3 and "regenerate: cached" in out3 and "drafters: ran" in out3
    assert len(list((run_dir / "previous").glob("drafters.*"))) == 1  # kept, not deleted
    # new evaluation prompts (one set too long for the context): only evaluate runs, on the
    # restored drafters of this configuration; the report counts what did not fit
    short = tmp_path / "mine.jsonl"
    short.write_text(
        json.dumps({"turns": ["What is 3 plus 4?"]}) + "\n"
        + json.dumps({"turns": ["word " * 3000]}) + "\n"
    )  # fmt: skip
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"turns": ["word " * 3000]}) + "\n")
    out4 = _run(
        ["--config", "configs/micro.py", "--run-dir", str(run_dir), "--stages", "evaluate",
         "--set", f"data.eval_prompt_files={short},{huge}"]
    )  # fmt: skip
    assert "restored the output of this configuration" in out4 and "evaluate: ran" in out4
    rep = json.loads((run_dir / "evaluate" / "report.json").read_text())
    assert rep["datasets"]["mine"]["prompts"] == 1 and rep["datasets"]["mine"]["too_long"] == 1
    assert rep["datasets_not_evaluated"]["huge"]["too_long"] == 1
    assert "nothing fits" in (run_dir / "evaluate" / "report.md").read_text()
    assert list((run_dir / "previous").glob("evaluate.*"))  # the first report is kept


def test_pipeline_eta_counts_the_stages_left_at_this_runs_pace():
    """The overall line prices each stage's work at the demo's measured rates and rescales the
    rest by the pace of the stages done: the demo's own config predicts its measured time."""
    from configs.tiny import config as tiny
    from dspark_jax.run.eta import PipelineEta
    from dspark_jax.run.staged import STAGES

    eta = PipelineEta(tiny(), STAGES)
    total = sum(eta.predicted.values())
    assert 20 * 60 < total < 40 * 60, total
    assert "about " in eta.line("corpus") and "(1/7)" in eta.line("corpus")
    eta.done("corpus", 4.0)
    eta.done("tokenizer", 3.0)
    eta.done("target", 2 * eta.predicted["target"])  # this machine is half as fast
    left = sum(eta.predicted[s] for s in STAGES[3:])
    assert f"about {2 * left / 60:.0f} min left" in eta.line("regenerate")
    regen = eta.predicted["regenerate"]
    eta.skipped("regenerate")  # a cached stage costs nothing
    assert f"about {2 * (left - regen) / 60:.0f} min left" in eta.line("drafters")


def test_pipeline_eta_on_a_checkpoint_of_ones_own_waits_for_a_measured_stage():
    """The demo's prices are its own small target's: on the Qwen3-4B preset they predict
    ~120,000 minutes. A run on its own checkpoint names no time until a stage that decodes or
    trains has run, then prices the rest at that run's pace."""
    from dspark_jax.run.eta import PipelineEta
    from dspark_jax.run.staged import STAGES

    ns: dict = {}
    exec((ROOT / "configs" / "qwen3_4b_dspark.py").read_text(), ns)
    cfg = apply_overrides(ns["config"](), ["target.path=/models/Qwen3-4B"])
    eta = PipelineEta(cfg, STAGES)
    for s in ("corpus", "tokenizer", "target", "regenerate"):
        line = eta.line(s)
        assert "min left" not in line and "time left known once a stage" in line, line
        eta.done(s, 1.0 if s != "regenerate" else 3600.0)
    pace = 3600.0 / eta.predicted["regenerate"]
    left = sum(eta.predicted[s] for s in STAGES[4:]) * pace
    assert f"about {left / 60:.0f} min left in all" in eta.line("drafters")
    # data with fewer prompts than the preset's caps: the pace is measured on the prompts it had
    eta = PipelineEta(cfg, STAGES)
    cap = cfg.regenerate.max_prompts + cfg.calibrate.max_prompts
    full = eta.predicted["regenerate"]
    eta.done("regenerate", 3600.0, {"prompts": cap // 100, "seconds": 3600.0})
    assert eta.pace() == pytest.approx(3600.0 / (full * (cap // 100) / cap))


def test_unknown_override_keys_are_errors():
    cfg = PipelineConfig()
    with pytest.raises(ConfigError, match="no field 'stepz'"):
        apply_overrides(cfg, ["drafters.stepz=3"])
    with pytest.raises(ConfigError, match="cannot parse"):
        apply_overrides(cfg, ["drafters.train.total_steps=abc"])
    got = apply_overrides(cfg, ["drafters.train.total_steps=7", "drafters.kinds=dspark,dflash"])
    assert got.drafters.train.total_steps == 7 and got.drafters.kinds == ("dspark", "dflash")
    got = apply_overrides(cfg, ["drafters.train.learning_rate=1e-3", "target.train.seed=3"])
    assert got.drafters.train.learning_rate == 1e-3 and got.target.train.seed == 3
    got = apply_overrides(cfg, ["drafters.train.seq_buckets=64", "target.train.seq_buckets=64,128"])
    assert got.drafters.train.seq_buckets == (64,) and got.target.train.seq_buckets == (64, 128)


def test_run_config_json_of_another_layout_is_one_error(tmp_path):
    """A config.json this version cannot read (a field it does not know) names the fix."""
    from dspark_jax.run.rundir import RunDir

    (tmp_path / "config.json").write_text(json.dumps({"drafters": {"nope": 1}}))
    with pytest.raises(ConfigError, match="does not match this version.*retrain"):
        RunDir(tmp_path)


def test_cli_reports_bad_config(tmp_path):
    env = dict(os.environ, TQDM_DISABLE="1")
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", "configs/micro.py", "--set",
         "nope=1", "--run-dir", str(tmp_path / "x")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "unknown config key 'nope'" in p.stderr
    assert not (tmp_path / "x").exists()  # nothing written before the error


# The 4B preset's lengths and counts, scaled by one factor (rounded, at least 1) so that they run
# on a tiny checkpoint on CPU: token lengths (regeneration, sequences, calibration, evaluation,
# context cap), data and batch counts (prompts, batch and micro-batch sizes, anchors and the
# anchor chunk, speed prompts); drafter batch sizes then rounded up to whole sequences per
# device of the mesh. 1/64 is the smallest factor whose sequences (64 tokens) still hold the
# tiny tokenizer's rendered prompt (~53 tokens with Qwen's default system prompt) plus a few
# answer tokens; the evaluation prompts are the training file's (short enough for the scaled
# 128-token context cap).
# Not scaled: the model (the tiny checkpoint and its feature layers replace Qwen3-4B's), the
# drafter architecture (γ, layers, Markov rank), sampling settings and the mesh (the preset's
# fsdp=2 x tensor=4 on 8 simulated devices); training length (steps, eval_interval) is cut to 2,
# which changes how long training runs, not what has to fit.
PRESET_SCALE = 1 / 64
_SCALED = {
    "regenerate": ("max_new_tokens", "max_prompts", "batch_size"),
    "drafters": ("num_anchors",),
    "drafters.train": ("global_batch_size", "seq_buckets", "micro_batch_size", "eval_batch_size",
                       "anchor_chunk"),
    "calibrate": ("max_prompts", "max_new_tokens"),
    "evaluate": ("max_prompts_per_dataset", "max_new_tokens", "batch_size", "max_len",
                 "speed_prompts"),
}  # fmt: skip


def scaled_preset_overrides(cfg: PipelineConfig, factor: float = PRESET_SCALE) -> list[str]:
    """`--set` overrides scaling every length and count of `cfg` listed in `_SCALED`; the
    drafters' batch sizes are rounded up to a multiple of the (unscaled) mesh's data x fsdp,
    which the trainer needs (whole sequences per device)."""
    shards = max(cfg.mesh.data, 1) * cfg.mesh.fsdp
    out = []
    for stage, fields in _SCALED.items():
        sec = cfg
        for part in stage.split("."):
            sec = getattr(sec, part)
        for f in fields:
            v = getattr(sec, f)
            if f == "seq_buckets":
                out.append(f"{stage}.{f}=" + ",".join(str(max(1, round(b * factor))) for b in v))
            elif v > 0:  # 0 / -1 mean "all" / "the target's" and stay as they are
                n = max(1, round(v * factor))
                if stage == "drafters.train" and "batch_size" in f:
                    n = -(-n // shards) * shards
                out.append(f"{stage}.{f}={n}")
    return out


@pytest.mark.slow
def test_real_target_preset_on_tiny_hf_checkpoint(tmp_path):
    """configs/qwen3_4b_dspark.py end to end on a tiny random Qwen3 checkpoint saved by
    transformers, every length and count as the preset sets them scaled by PRESET_SCALE, on the
    preset's fsdp=2 x tensor=4 mesh (8 simulated CPU devices): every stage runs on the mesh.
    DSpark only: DFlash and Eagle3 on fsdp x tensor meshes are covered where they differ from
    DSpark — training (tests/test_distributed.py), the sharded serving engine
    (tests/test_engine_sharded.py) — and all three through every stage by the micro preset's test
    above; each took ~45 s of compiling here on 8 simulated devices."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspark_jax.testing import tiny_tokenizer

    ns: dict = {}
    exec((ROOT / "configs" / "qwen3_4b_dspark.py").read_text(), ns)
    preset = ns["config"]()
    assert (preset.mesh.fsdp, preset.mesh.tensor) == (2, 4)
    ckpt = tmp_path / "qwen3-tiny"
    tok = tiny_tokenizer(tmp_path / "tokcache")
    tok.save_pretrained(ckpt)
    torch.manual_seed(0)
    hf_cfg = Qwen3Config(
        vocab_size=576, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True,
        max_position_embeddings=1024,
    )  # fmt: skip
    Qwen3ForCausalLM(hf_cfg).save_pretrained(ckpt)
    conv = tmp_path / "train.jsonl"
    rows = [
        {"conversations": [{"role": "user", "content": f"What is {i} plus {i + 1}?"},
                           {"role": "assistant", "content": f"{i} + {i + 1} = {2 * i + 1}."}]}
        for i in range(40)
    ]  # fmt: skip
    conv.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    evals = [str(conv)]
    run_dir = tmp_path / "run"
    sets = [
        f"target.path={ckpt}", "target.target_layer_ids=0,1,2",  # the model swap
        f"data.conversation_files={conv}", "data.eval_prompt_files=" + ",".join(evals),
        "drafters.kinds=dspark",
        "drafters.train.total_steps=2", "drafters.train.eval_interval=2",
        "drafters.train.checkpoint_interval=2",
        "evaluate.speed_reps=0",  # the timing breakdown: minutes of compiling on 8 CPU devices
        *scaled_preset_overrides(preset),
    ]  # fmt: skip
    assert "drafters.train.seq_buckets=64" in sets and "evaluate.max_len=128" in sets
    # 4/64 -> 1 -> whole sequences per fsdp shard
    assert "drafters.train.micro_batch_size=2" in sets
    assert "drafters.train.eval_batch_size=2" in sets
    args = ["--config", "configs/qwen3_4b_dspark.py", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    out = _run(args, devices=8, timeout=1200)
    # the demo's prices do not fit a checkpoint of one's own: no number until a stage has run
    lines = {x.split(" (")[0]: x for x in out.splitlines() if x.startswith("[pipeline] ")}
    assert "time left known once" in lines["[pipeline] regenerate"]
    assert "min left in all" in lines["[pipeline] drafters"]
    rep = _check_report(run_dir, kinds=("dspark",))
    assert set(rep["datasets"]) == {Path(e).stem for e in evals}


@pytest.mark.slow
def test_gemma4_preset_on_tiny_hf_checkpoint(tmp_path):
    """configs/gemma4_micro.py end to end on a tiny random `Gemma4ForCausalLM` (sliding and global
    layers, proportional RoPE, soft-capped logits; tests/test_gemma4.py's) saved by transformers,
    with a tokenizer of Gemma 4's chat format (`testing.gemma4_style_tokenizer`): regeneration,
    the DSpark drafter, calibration and the report, rendered the Gemma 4 way (model turns, the
    thought prefix outside the loss, no system prompt) and stopping at `<turn|>`."""
    pytest.importorskip("torch")
    from dspark_jax.run.pipeline import Pipeline
    from dspark_jax.templates import RenderConfig
    from dspark_jax.testing import gemma4_style_tokenizer
    from tests.test_gemma4 import LAYER_IDS, _hf_model

    ckpt = tmp_path / "gemma4-tiny"
    tok = gemma4_style_tokenizer(tmp_path / "tokcache")
    tok.save_pretrained(ckpt)
    _hf_model({"vocab_size": 576}, seed=0).save_pretrained(ckpt)
    conv = tmp_path / "train.jsonl"
    rows = [
        {"conversations": [{"role": "user", "content": f"What is {i} plus {i + 1}?"},
                           {"role": "assistant", "content": f"{i} + {i + 1} = {2 * i + 1}."}]}
        for i in range(40)
    ]  # fmt: skip
    conv.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    sets = [
        f"target.path={ckpt}", "target.target_layer_ids=" + ",".join(map(str, LAYER_IDS)),
        f"data.conversation_files={conv}", f"data.eval_prompt_files={conv}",
        # the speed breakdown and the greedy table: two more rounds of compiling (minutes here)
        "evaluate.speed_reps=0", "evaluate.temperatures=",
        # DSpark alone: the three drafters on Gemma 4 (training, every engine form) are
        # tests/test_gemma4_drafters.py's; the stages' code is the same for each kind
        "drafters.kinds=dspark",
    ]  # fmt: skip
    args = ["--config", "configs/gemma4_micro.py", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    _run(args, timeout=900)
    _check_report(run_dir, kinds=("dspark",))
    rd = RunDir(run_dir)
    assert rd.target()[0].architecture == "gemma4"
    assert Pipeline(rd.config, log=lambda *a: None).render_config() == RenderConfig.gemma4()
    assert tok.convert_tokens_to_ids("<turn|>") in rd.stop_ids()
    assert rd.mask_token_id(rd.target()[0]) == tok.convert_tokens_to_ids("<|mask|>")


class _GemmaLikeVocab:
    """What RunDir reads of a Gemma tokenizer: `<mask>` at 4 (docs/METHOD.md §0), an end-of-turn
    `<turn|>` (its id here is made up), `<eos>`, and no spare embedding row."""

    unk_token_id, eos_token_id = 3, 1

    def __init__(self, mask: bool = True):
        self.ids = {"<eos>": 1, "<turn|>": 50, **({"<mask>": 4} if mask else {})}

    def convert_tokens_to_ids(self, token):
        return self.ids.get(token, self.unk_token_id)

    def __len__(self):
        return 262_144


def test_gemma_mask_token_and_end_of_turn_come_from_the_tokenizer(tmp_path):
    rd = RunDir(tmp_path, config=PipelineConfig())
    rd.set_tokenizer(_GemmaLikeVocab())
    assert rd.mask_token_id(TargetConfig(vocab_size=262_144)) == 4
    assert rd.stop_ids() == [50, 1]
    rd.set_tokenizer(_GemmaLikeVocab(mask=False))
    with pytest.raises(ConfigError, match=re.escape("no <|mask|> or <mask> token")):
        rd.mask_token_id(TargetConfig(vocab_size=262_144))
