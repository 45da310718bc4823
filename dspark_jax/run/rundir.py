"""`RunDir`: everything a consumer needs from a trained run directory, in one place.

A run directory written by `train.py` is self-contained: every path inside it is resolved
relative to the directory itself (never the current directory), so it can be loaded from any
cwd and after it was copied or moved. External inputs (`target.path`, `tokenizer.path`) are
stored as absolute paths in `config.json` by the pipeline.

    run = RunDir("runs/tiny")
    tok = run.tokenizer()
    tcfg, tparams = run.target()
    dcfg, dparams = run.drafter("dspark")      # best checkpoint
    sts = run.sts()                            # calibration (or None)
    cost = run.cost_profile()                  # <run>/cost_profile.json (or None)

Loaded objects are cached on the instance (a run directory is read once per process).

Importing this module imports jax, the models and the engine: the CLIs import it only once their
flags and configuration are checked (cli/serve_engine.py, run/staged.py).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from dspark_jax import drafters as dr
from dspark_jax.compat import check_sts, load_cost_profile
from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.config.pipeline import PipelineConfig
from dspark_jax.drafters.compat import TargetId, vocab_hash
from dspark_jax.drafters.hf import save_hf_drafter
from dspark_jax.engine import ServingEngine
from dspark_jax.engine.engine import MODES
from dspark_jax.errors import CheckpointError, ConfigError, RequestError
from dspark_jax.models.hf import load_target, load_tokenizer
from dspark_jax.parallel import shard_params
from dspark_jax.sched.sts import STS
from dspark_jax.storage import as_path, copy_tree, is_url, local_copy
from dspark_jax.train.checkpoint import load_best_params
from dspark_jax.train.memory import resolve_dtypes

DRAFTER_KINDS = ("dspark", "dflash", "eagle3")
# prompt-length buckets of the evaluation / generation decoder (those below max_len are used)
LENGTH_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class RunDir:
    """A trained run directory. `config` is read from `<path>/config.json` unless given."""

    def __init__(self, path, config: PipelineConfig | None = None, mesh=None):
        """`mesh` (a `jax.sharding.Mesh`, default None = one device): the target, the drafters
        and the decoders are placed on it by the logical-axis table (`parallel.LOGICAL_RULES`)."""
        # a local path (made absolute) or a bucket URL (`storage.as_path`)
        self.path = path if is_url(path) else Path(path).expanduser().resolve()
        self.path = as_path(self.path)
        self.mesh = mesh
        if config is None:
            config = self._read_config()
        self.config: PipelineConfig = config
        self._cache: dict[str, Any] = {}
        # where each decoder's memory plan per device is reported, once per distinct plan (the
        # pipeline sets its log; None: not reported)
        self.log = None

    def _read_config(self) -> PipelineConfig:
        f = self.path / "config.json"
        if not self.path.is_dir():
            raise FileNotFoundError(
                f"run directory {self.path} does not exist — train one first: "
                f"python train.py --config configs/tiny.py --run-dir {self.path}"
            )
        if not f.is_file():
            raise FileNotFoundError(
                f"{f} not found — {self.path} is not a run directory written by train.py"
            )
        try:
            d = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{f} is not valid JSON ({e}) — restore it or retrain") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{f} must hold a JSON object — restore it or retrain")
        try:
            return PipelineConfig.from_json(d)
        except (ConfigError, TypeError) as e:
            raise ConfigError(
                f"{f} does not match this version's configuration ({e}) — retrain into a new "
                "run directory"
            ) from None

    # -- layout ---------------------------------------------------------------------------

    def stage_dir(self, stage: str) -> Path:
        return self.path / stage

    def forget(self, *names: str) -> None:
        """Drop cached objects (e.g. after the pipeline retrained the target)."""
        for n in names or list(self._cache):
            self._cache.pop(n, None)

    # -- tokenizer ------------------------------------------------------------------------

    def tokenizer_path(self) -> Path:
        c = self.config
        return as_path(c.tokenizer.path or c.target.path or self.stage_dir("tokenizer"))

    def local_path(self, path, stage: str) -> Path:
        """`path` itself, or for a URL (a run directory on a bucket) a cached local copy of it
        (`storage.local_copy`, keyed by `stage`'s done.json key): tokenizers and safetensors
        are read from POSIX paths."""
        if not is_url(path):
            return Path(path)
        done = as_path(self.stage_dir(stage)) / "done.json"
        key = json.loads(done.read_text()).get("key", "") if done.is_file() else ""
        return local_copy(path, stamp=key)

    def tokenizer(self):
        if "tok" not in self._cache:
            path = self.local_path(self.tokenizer_path(), "tokenizer")
            self._cache["tok"] = load_tokenizer(path, require_chat_template=True)
        return self._cache["tok"]

    def set_tokenizer(self, tok) -> None:
        self._cache["tok"] = tok

    def stop_ids(self) -> list[int]:
        tok = self.tokenizer()
        ids = []
        for name in ("<|im_end|>", "<|endoftext|>", "<turn|>"):  # ChatML, Gemma 4 end of turn
            i = tok.convert_tokens_to_ids(name)
            if isinstance(i, int) and i >= 0 and i != tok.unk_token_id:
                ids.append(i)
        if tok.eos_token_id is not None and tok.eos_token_id not in ids:
            ids.append(tok.eos_token_id)
        return ids

    def mask_token_id(self, tcfg: TargetConfig) -> int:
        tok = self.tokenizer()
        for name in ("<|mask|>", "<mask>"):  # ours; Gemma's (id 4, docs/METHOD.md §0)
            i = tok.convert_tokens_to_ids(name)
            if isinstance(i, int) and i >= 0 and i != tok.unk_token_id:
                return i
        # Qwen3 convention: the first embedding row past the tokenizer's vocabulary
        n = len(tok)
        if n >= tcfg.vocab_size:
            raise ConfigError(
                "no <|mask|> or <mask> token and no spare embedding row for the drafter's mask "
                "token — add <|mask|> to the tokenizer"
            )
        return n

    # -- target -----------------------------------------------------------------------------

    def target_path(self) -> Path:
        return as_path(self.config.target.path or self.stage_dir("target") / "hf")

    def target(self) -> tuple[TargetConfig, Any]:
        if "target" not in self._cache:
            path = self.target_path()
            if not (path / "config.json").is_file():
                raise FileNotFoundError(
                    f"no target checkpoint in {path} — run the target stage: "
                    f"python train.py --config <preset> --run-dir {self.path}"
                )
            self._cache["target"] = load_target(
                self.local_path(path, "target"),
                target_layer_ids=self.config.target.target_layer_ids or None,
                mesh=self.mesh,
                dtype=self.target_dtype(),
            )
        return self._cache["target"]

    def target_dtype(self) -> str:
        """The dtype the target is loaded and decoded in: the run's `drafters.train.target_dtype`
        ("auto": bfloat16 on GPU / TPU, float32 on CPU), as the drafters were trained against."""
        return resolve_dtypes(self.config.drafters.train).target_dtype

    # -- drafters ---------------------------------------------------------------------------

    def drafter_config(self, kind: str, tcfg: TargetConfig) -> DrafterConfig:
        d = self.config.drafters
        common = dict(block_size=d.block_size, seed=d.train.seed, context_window=d.context_window)
        if kind == "eagle3":
            return DrafterConfig.eagle3(tcfg, **common)
        common.update(
            num_layers=d.num_layers,
            num_anchors=d.num_anchors,
            mask_token_id=self.mask_token_id(tcfg),
        )
        if kind == "dflash":
            return DrafterConfig.dflash(tcfg, **common)
        return DrafterConfig.dspark(
            tcfg, markov_rank=d.markov_rank, markov_head_type=d.markov_head_type, **common
        )

    def target_name(self) -> str:
        """The name a drafter records for its target: the target checkpoint directory's name,
        "embedded" for the target this run trained."""
        return Path(self.config.target.path).name if self.config.target.path else "embedded"

    def vocab_hash(self) -> str:
        """`drafters.compat.vocab_hash` of the run's tokenizer (recorded with each drafter)."""
        if "vocab_hash" not in self._cache:
            self._cache["vocab_hash"] = vocab_hash(self.tokenizer())
        return self._cache["vocab_hash"]

    def drafter_dir(self, kind: str) -> Path:
        return self.stage_dir("drafters") / kind

    def drafter(self, kind: str):
        """`(DrafterConfig, DrafterParams)` of the best checkpoint of drafter `kind`."""
        if kind not in DRAFTER_KINDS:
            raise ConfigError(f"unknown drafter kind {kind!r} — use one of {DRAFTER_KINDS}")
        key = f"drafter_{kind}"
        if key not in self._cache:
            best = self.drafter_dir(kind) / "best"
            if kind not in self.config.drafters.kinds or not best.is_dir():
                trained = [k for k in self.config.drafters.kinds if self.has_drafter(k)]
                raise CheckpointError(
                    f"no trained {kind} drafter in {self.path} (no {best}) — use "
                    + (f"--drafter {trained[0]}" if trained else "train.py to train one")
                )
            tcfg, tparams = self.target()
            dcfg = self.drafter_config(kind, tcfg)
            params = dr.init_params(dcfg, target_params=tparams)
            _, trainable, _ = load_best_params(
                self.drafter_dir(kind), params.trainable, target_cfg=tcfg, drafter_cfg=dcfg,
                target_name=self.target_name(), vocab_hash=self.vocab_hash(),
            )  # fmt: skip
            params = dr.DrafterParams(trainable, params.frozen)
            if self.mesh is not None:
                params = dr.DrafterParams(*(shard_params(p, self.mesh) for p in params))
            self._cache[key] = (dcfg, params)
        return self._cache[key]

    def has_drafter(self, kind: str) -> bool:
        return (self.drafter_dir(kind) / "best").is_dir()

    def export_drafter(self, kind: str, out_dir) -> Path:
        """Write drafter `kind`'s best checkpoint to `out_dir` (new or empty) as a Hugging Face
        drafter checkpoint carrying the run's STS calibration (when calibrated) and the target it
        was trained for (`drafters.hf.save_hf_drafter`); `serve.py serve --target --drafter`
        loads it."""
        out = as_path(out_dir if is_url(out_dir) else Path(out_dir).expanduser().resolve())
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"{out} exists and is not an empty directory — choose a new --out")
        dcfg, params = self.drafter(kind)
        tid = TargetId.of(dcfg.target, name=self.target_name(), vocab_hash=self.vocab_hash())
        if not is_url(out):
            save_hf_drafter(dcfg, params, out, sts=self.sts(kind), trained_for=tid)
            return out
        # a bucket: written locally (safetensors writes a file name), uploaded config.json last
        with tempfile.TemporaryDirectory(prefix="dspark-export-") as tmp:
            save_hf_drafter(dcfg, params, tmp, sts=self.sts(kind), trained_for=tid)
            copy_tree(tmp, out, last="config.json")
        return out

    # -- calibration and cost -----------------------------------------------------------------

    def sts(self, kind: str = "dspark"):
        """The STS calibration of `kind`'s confidences, or None (not calibrated / no confidences)."""
        f = self.stage_dir("calibrate") / "sts.json"
        if kind != "dspark" or not f.is_file():
            return None
        sts = STS.load(f)
        check_sts(sts, self.config.drafters.block_size)  # fitted for this γ
        return sts

    def cost_profile_path(self) -> Path:
        return self.path / "cost_profile.json"

    def cost_profile(self):
        """The `CostProfile` in `<run>/cost_profile.json`, or None when there is none (refused
        when it records another device; `compat.load_cost_profile`)."""
        f = self.cost_profile_path()
        return load_cost_profile(f) if f.is_file() else None

    # -- decoding ---------------------------------------------------------------------------

    def context_len(self) -> int:
        """Positions the target takes: prompt + generation + lookahead must fit."""
        return self.target()[0].max_position_embeddings

    def prompt_limit(self, max_new_tokens: int, cap: int = 0) -> int:
        """Longest prompt that fits `max_new_tokens` in the target's context (or in `cap`
        tokens when smaller; `cap=0`: the target's context). The engine adds the γ + 1
        lookahead positions of verification to its cache (`EngineConfig.max_len_for`)."""
        ctx = self.context_len()
        ctx = min(cap, ctx) if cap else ctx
        return ctx - max_new_tokens

    def decoder(
        self, kind: str, max_len: int | None = None, length_buckets=None, *, num_slots=0,
        rounds_per_call=1, token_buckets=None, modes=None, context_window=None,
    ):  # fmt: skip
        """A `ServingEngine` of the target and drafter `kind` (`max_len` defaults to
        `evaluate.max_len`, 0 = the target's context), `num_slots` slots (0 =
        `evaluate.batch_size`), fixed γ (switch with `engine.set_policy`); `rounds_per_call`,
        `token_buckets` (default: powers of two up to slots x (γ + 1)) and the compiled sampling
        `modes` (default: all) are the engine's; `context_window` narrows the drafter's
        (None: as trained)."""
        ctx = self.context_len()
        tokens = min(self.config.evaluate.max_len or ctx, ctx)
        max_len = max_len or tokens + self.config.drafters.block_size + 1  # + γ + 1 lookahead
        tcfg, tparams = self.target()
        dcfg, dparams = self.drafter(kind)
        buckets = length_buckets or (
            tuple(b for b in LENGTH_BUCKETS if b < max_len) or (max_len // 2,)
        )
        engine = ServingEngine(
            tcfg, dcfg, tparams, dparams,
            num_slots=self._slots(num_slots), max_len=max_len,
            prompt_buckets=tuple(buckets), policy="fixed", mesh=self.mesh,
            rounds_per_call=rounds_per_call, token_buckets=token_buckets, modes=modes or MODES,
            context_window=context_window,
            device_memory_gib=self.config.drafters.train.device_memory_gib,
        )  # fmt: skip
        slots = engine.config.num_slots
        plan = f"  {kind} decoder ({slots} slot{'' if slots == 1 else 's'} x {max_len}): " + (
            engine.memory_plan.summary()
        )
        logged = self._cache.setdefault("logged_plans", set())
        if self.log is not None and plan not in logged:
            logged.add(plan)
            self.log(plan)
        return engine

    def _slots(self, num_slots: int) -> int:
        """A decoder's slots: `num_slots`, or 0 for `evaluate.batch_size`."""
        return num_slots or max(1, self.config.evaluate.batch_size)

    def decoder_for(
        self, kind: str, prompt_lens, max_new_tokens: int, cap: int = 0, *, lean=False, **engine
    ):
        """A decoder sized for these prompts: prompt buckets up to the longest prompt (at most the
        target's context minus the generation budget), cache just long enough (`engine`:
        `decoder`'s num_slots / rounds_per_call / token_buckets).

        `lean` (the pipeline's fixed-γ decoders, which run a few hundred prompts once): one
        prompt bucket (the longest prompt's) and, unless `token_buckets` is given, two token
        buckets (all slots' γ + 1 tokens, and half of it), so that a cold start compiles a
        quarter of the programs (each 5-10 s for the demo's 16-layer target on 2 CPU cores)
        for a little more verify work in a batch's last rounds."""
        limit = self.prompt_limit(max_new_tokens, cap)
        longest = max(prompt_lens)
        if longest > limit:
            raise RequestError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} does not fit "
                f"the target's context ({self.context_len()} positions, {limit} left for the "
                "prompt) — shorten the prompt or lower max_new_tokens"
            )
        top = min(next((b for b in LENGTH_BUCKETS if b >= longest), limit), limit)
        buckets = tuple(b for b in LENGTH_BUCKETS if b < top) + (top,)
        g1 = self.config.drafters.block_size + 1
        if lean:
            buckets = (top,)
            full = self._slots(engine.get("num_slots", 0)) * g1
            engine.setdefault("token_buckets", (max(g1, full // 2), full))
        # the prompt bucket + the new tokens + γ + 1 lookahead positions (at most the
        # context + γ + 1: `EngineConfig.max_len_for`)
        extra = max_new_tokens + g1
        return self.decoder(kind, max_len=top + extra, length_buckets=buckets, **engine)
