"""The end-to-end pipeline behind `train.py`: corpus → tokenizer → target → regenerate →
drafters → calibrate → evaluate.

Every stage writes into its own folder of the run directory and finishes by writing a
`done.json` marker (atomically, last) that records a hash of the configuration it depends on.
Re-running skips a stage whose marker matches; a changed configuration redoes that stage and
everything after it. Stages that take long (target, regeneration, drafters) also resume from
inside: checkpoints and regeneration shards survive an interruption.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from dspark_jax.config import ConfigError, TrainConfig
from dspark_jax.pipeline_config import PipelineConfig
from dspark_jax.run.rundir import RunDir

STAGES = ("corpus", "tokenizer", "target", "regenerate", "drafters", "calibrate", "evaluate")
# what each stage's cache key depends on (its own section and the stages before it)
_DEPENDS = {
    "corpus": ("data",),
    "tokenizer": ("data", "tokenizer"),
    "target": ("data", "tokenizer", "target"),
    "regenerate": ("data", "tokenizer", "target", "regenerate"),
    "drafters": ("data", "tokenizer", "target", "regenerate", "drafters"),
    "calibrate": ("data", "tokenizer", "target", "regenerate", "drafters", "calibrate"),
    "evaluate": (
        "data", "tokenizer", "target", "regenerate", "drafters", "calibrate", "evaluate",
    ),
}  # fmt: skip


def _hash(cfg: PipelineConfig, stage: str) -> str:
    d = cfg.to_json()
    sub = {k: d[k] for k in _DEPENDS[stage]}
    return hashlib.sha256(json.dumps(sub, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


class Pipeline:
    def __init__(self, cfg: PipelineConfig, *, log=print):
        self.cfg = cfg
        self.run = Path(cfg.run_dir)
        self.log = log
        self.timings: dict[str, float] = {}
        self.status: dict[str, str] = {}
        self.rundir = RunDir(self.run, config=cfg)
        self._validate()

    # -- bookkeeping -----------------------------------------------------------------------

    def _validate(self):
        c = self.cfg
        for f in (*c.data.conversation_files, *c.data.eval_prompt_files):
            if not Path(f).exists():
                raise ConfigError(f"data file {f} does not exist")
        if c.target.path and not (Path(c.target.path) / "config.json").exists():
            raise ConfigError(f"target.path={c.target.path!r} has no config.json")
        for k in c.drafters.kinds:
            if k not in ("dspark", "dflash", "eagle3"):
                raise ConfigError(f"unknown drafter kind {k!r} in drafters.kinds")
        if "dspark" not in c.drafters.kinds and c.calibrate.max_prompts:
            pass  # calibration is a no-op without DSpark

    def stage_dir(self, stage: str) -> Path:
        return self.run / stage

    def is_done(self, stage: str) -> bool:
        m = self.stage_dir(stage) / "done.json"
        if not m.exists():
            return False
        try:
            return json.loads(m.read_text()).get("hash") == _hash(self.cfg, stage)
        except (OSError, json.JSONDecodeError):
            return False

    def mark_done(self, stage: str, info: dict):
        write_json_atomic(
            self.stage_dir(stage) / "done.json",
            {"hash": _hash(self.cfg, stage), "time": time.time(), **info},
        )

    def done_info(self, stage: str) -> dict:
        return json.loads((self.stage_dir(stage) / "done.json").read_text())

    def run_stages(self, stages=STAGES, *, force=()):
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise ConfigError(f"unknown stage(s) {unknown}; stages: {STAGES}")
        self.run.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.run / "config.json", self.cfg.to_json())
        for s in STAGES:
            if s not in stages:
                continue
            if self.is_done(s) and s not in force:
                self.status[s] = "cached"
                self.log(f"[{s}] cached ({self.stage_dir(s)})")
                continue
            self._prepare_stage_dir(s, fresh=s in force)
            self.log(f"[{s}] running")
            t0 = time.perf_counter()
            info = getattr(self, f"_stage_{s}")()
            self.timings[s] = time.perf_counter() - t0
            self.mark_done(s, {"seconds": self.timings[s], **(info or {})})
            self.status[s] = "ran"
            self.log(f"[{s}] done in {self.timings[s]:.1f}s")
        return self.status

    def _prepare_stage_dir(self, stage: str, fresh: bool):
        """Keep a stage's partial work (checkpoints, shards) only if it was made with the same
        configuration; anything from another configuration (or a forced redo) is removed."""
        d = self.stage_dir(stage)
        tag = d / "stage_hash"
        h = _hash(self.cfg, stage)
        if d.exists() and (fresh or not tag.exists() or tag.read_text().strip() != h):
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        tag.write_text(h)

    def _require(self, stage: str):
        if not self.is_done(stage):
            raise ConfigError(
                f"stage {stage!r} has not run with this configuration; run it first "
                f"(--stages {stage},...) or drop --stages"
            )

    # -- shared loaders (the run directory's, see dspark_jax.run.rundir) -----------------------

    def tokenizer(self):
        return self.rundir.tokenizer()

    def stop_ids(self) -> list[int]:
        return self.rundir.stop_ids()

    def target(self):
        return self.rundir.target()

    def drafter(self, kind: str):
        return self.rundir.drafter(kind)

    def decoder(self, kind: str):
        return self.rundir.decoder(kind)

    def corpus_files(self):
        from dspark_jax.train.corpus import build_corpus

        return build_corpus(self.stage_dir("corpus"), self.cfg.data.corpus)

    def eval_sets(self) -> dict[str, tuple[str, list[list[str]]]]:
        """dataset name -> (domain, prompts as lists of user turns)."""
        from dspark_jax.train.data import read_prompts, select_prompts

        c = self.cfg
        files = {}
        if c.data.eval_prompt_files:
            for f in c.data.eval_prompt_files:
                files[Path(f).stem] = (Path(f).stem, Path(f))
        else:
            for dom, p in self.corpus_files().heldout.items():
                files[dom] = (dom, p)
        out = {}
        for name, (dom, p) in files.items():
            prompts, _ = read_prompts(p)
            sel = select_prompts(prompts, c.evaluate.max_prompts_per_dataset)
            out[name] = (dom, [list(pr.turns) for pr in sel])
        return out

    # -- stages ---------------------------------------------------------------------------------

    def _stage_corpus(self):
        c = self.cfg
        if c.data.conversation_files:
            return {"source": "user files", "files": list(c.data.conversation_files)}
        files = self.corpus_files()
        self.log(
            f"  corpus: {json.dumps(files.stats.get('domains', files.stats), default=str)[:300]}"
        )
        return {"stats": files.stats}

    def _stage_tokenizer(self):
        c = self.cfg
        if c.tokenizer.path or c.target.path:
            tok = self.tokenizer()
            return {"source": c.tokenizer.path or c.target.path, "vocab": len(tok)}
        from dspark_jax.train.tokenizer import train_tokenizer

        self._require("corpus")
        files = self.corpus_files()
        tok = train_tokenizer(files.text, self.stage_dir("tokenizer"), c.tokenizer.vocab_size)
        self.rundir.set_tokenizer(tok)
        return {"vocab": len(tok)}

    def _training_conversations(self):
        from dspark_jax.train.data import read_conversations

        c = self.cfg
        paths = c.data.conversation_files or (str(self.corpus_files().train_conversations),)
        convs = []
        for p in paths:
            got, stats = read_conversations(p)
            self.log(f"  {stats.summary()}")
            convs += got
        if not convs:
            raise ConfigError(f"no usable training conversations in {paths}")
        return convs

    def _stage_target(self):
        c = self.cfg
        if c.target.path:
            tcfg, _ = self.target()
            return {"source": c.target.path, "params": _count(self.target()[1])}
        from dspark_jax.models.hf import save_target_hf
        from dspark_jax.train.data import RenderConfig, encode_conversations
        from dspark_jax.train.lm import LMTrainConfig, train_lm

        tok = self.tokenizer()
        vocab = _round_up(len(tok), 64)
        tcfg = c.target.model.replace(vocab_size=vocab)
        convs = self._training_conversations()
        rc = RenderConfig(max_length=c.target.seq_len * 4, min_loss_tokens=1)
        samples, _ = encode_conversations(tok, convs, rc)
        rng = np.random.default_rng(c.target.seed)
        order = rng.permutation(len(samples))
        n_held = max(1, len(samples) // 50)
        held = [samples[i].input_ids for i in order[:n_held]]
        train = [samples[i].input_ids for i in order[n_held:]]
        lm = LMTrainConfig(
            steps=c.target.steps, batch_size=c.target.batch_size, seq_len=c.target.seq_len,
            lr=c.target.lr, warmup_frac=c.target.warmup_frac, seed=c.target.seed,
        )  # fmt: skip
        self.log(
            f"  target: {tcfg.num_layers} layers, hidden {tcfg.hidden_size}, vocab {vocab}; "
            f"{sum(len(t) for t in train)} training tokens"
        )
        params, log = train_lm(tcfg, train, lm, self.stage_dir("target"), heldout_token_lists=held)
        save_target_hf(tcfg, params, self.stage_dir("target") / "hf", tokenizer=tok)
        self.rundir.forget("target")
        write_json_atomic(self.stage_dir("target") / "train_log.json", log)
        return {"params": _count(params), "final": log[-1] if log else None}

    def _regen_prompts(self):
        """Training prompts (user turns) in a fixed order; the last `calibrate.max_prompts` form
        the calibration split (never used to train drafters)."""
        convs = self._training_conversations()
        rng = np.random.default_rng(self.cfg.regenerate.seed)
        order = rng.permutation(len(convs))
        n = min(len(convs), self.cfg.regenerate.max_prompts + self.cfg.calibrate.max_prompts)
        return [list(convs[i].user_turns()) for i in order[:n]]

    def _stage_regenerate(self):
        from dspark_jax.models.generate import generate
        from dspark_jax.train.data import encode_prompt

        c = self.cfg.regenerate
        tcfg, tparams = self.target()
        tok = self.tokenizer()
        prompts = self._regen_prompts()
        stop = self.stop_ids()
        shard_dir = self.stage_dir("regenerate") / "shards"
        shard_dir.mkdir(parents=True, exist_ok=True)
        shard = max(c.batch_size, 1) * 4
        bar = tqdm(total=len(prompts), desc="regenerate", unit="prompt")
        written = 0
        for lo in range(0, len(prompts), shard):
            path = shard_dir / f"{lo // shard:05d}.jsonl"
            chunk = prompts[lo : lo + shard]
            if path.exists():  # resumed: this shard was finished before
                bar.update(len(chunk))
                written += len(chunk)
                continue
            msgs = [[] for _ in chunk]
            max_turns = max(len(t) for t in chunk)
            for turn in range(max_turns):  # multi-turn prompts answered turn by turn
                idx = [i for i, t in enumerate(chunk) if len(t) > turn]
                for i in idx:
                    msgs[i].append({"role": "user", "content": chunk[i][turn]})
                toks = [list(encode_prompt(tok, msgs[i])) for i in idx]
                keep = [j for j, t in enumerate(toks) if len(t) + c.max_new_tokens <= 1024]
                outs = generate(
                    tcfg, tparams, [toks[j] for j in keep], max_new_tokens=c.max_new_tokens,
                    sampling={"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k},
                    stop_ids=stop, seeds=[c.seed + lo + idx[j] for j in keep],
                    batch_buckets=(c.batch_size,), length_buckets=(64, 128, 256, 512, 1024),
                )  # fmt: skip
                for j, out in zip(keep, outs):
                    text = tok.decode([t for t in out if t not in stop], skip_special_tokens=True)
                    msgs[idx[j]].append({"role": "assistant", "content": text.strip() or "."})
            rows = [
                {"id": lo + i, "conversations": m}
                for i, m in enumerate(msgs)
                if m and m[-1]["role"] == "assistant"
            ]
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
            os.replace(tmp, path)
            written += len(chunk)
            bar.update(len(chunk))
        bar.close()
        return {"prompts": len(prompts)}

    def _regenerated(self):
        from dspark_jax.train.data import read_conversations

        convs = []
        for p in sorted((self.stage_dir("regenerate") / "shards").glob("*.jsonl")):
            got, _ = read_conversations(p)
            convs += got
        n_cal = min(self.cfg.calibrate.max_prompts, max(len(convs) // 10, 1))
        return convs[: len(convs) - n_cal], convs[len(convs) - n_cal :]

    def _stage_drafters(self):
        from dspark_jax.train.data import RenderConfig, encode_conversations
        from dspark_jax.train.trainer import Trainer

        d = self.cfg.drafters
        tcfg, tparams = self.target()
        tok = self.tokenizer()
        train_convs, _ = self._regenerated()
        rc = RenderConfig(max_length=d.seq_len, min_loss_tokens=4)
        samples, stats = encode_conversations(tok, train_convs, rc)
        self.log(f"  {stats.summary()}")
        n_eval = max(d.batch_size, len(samples) // 20)
        eval_s, train_s = samples[:n_eval], samples[n_eval:]
        info = {}
        for kind in d.kinds:
            dcfg = self.rundir.drafter_config(kind, tcfg)
            tc = TrainConfig(
                learning_rate=d.lr, total_steps=d.steps, warmup_ratio=0.05,
                global_batch_size=d.batch_size, micro_batch_size=d.batch_size,
                seq_buckets=(d.seq_len,), compute_dtype="float32", eval_interval=d.eval_every,
                eval_batch_size=d.batch_size, max_eval_batches=4, checkpoint_interval=d.eval_every,
                seed=dcfg.seed, pad_id=0,
            )  # fmt: skip
            trainer = Trainer.for_drafter(
                tc, dcfg, tparams, train_data=train_s, eval_data=eval_s,
                run_dir=self.stage_dir("drafters") / kind,
            )  # fmt: skip
            self.log(f"  training {kind}: {_count(trainer.trainable)} trainable parameters")
            res = trainer.run()
            info[kind] = {"best_step": res.best_step, "best_sim_tau": res.best_score}
        return info

    def max_prompt_len(self, max_new_tokens: int) -> int:
        """Longest prompt the evaluation decoder takes (prompt + new tokens + γ + 1 ≤ max_len)."""
        e = self.cfg.evaluate
        limit = e.max_len - max_new_tokens - self.cfg.drafters.block_size - 2
        return min(limit, max(self.rundir.length_buckets(e.max_len)))

    def _stage_calibrate(self):
        from dspark_jax.eval.offline import EvalDataset, calibration_pairs, run_dataset
        from dspark_jax.sched.sts import fit_sts
        from dspark_jax.spec.metrics import reliability_from_logits
        from dspark_jax.train.data import encode_prompt

        if "dspark" not in self.cfg.drafters.kinds:
            return {"skipped": "no dspark drafter"}
        c = self.cfg.calibrate
        tok = self.tokenizer()
        _, cal = self._regenerated()
        prompts = tuple(tuple(encode_prompt(tok, cv.user_turns()[0]).tolist()) for cv in cal)
        prompts = tuple(p for p in prompts if len(p) <= self.max_prompt_len(c.max_new_tokens))
        dec = self.decoder("dspark")
        g = dec.dcfg.block_size
        res = run_dataset(
            dec, EvalDataset("calibration", "mixed", prompts), max_new_tokens=c.max_new_tokens,
            temperature=self.cfg.evaluate.temperature, seed=12345, stop_ids=self.stop_ids(),
            batch_size=self.cfg.evaluate.batch_size,
        )  # fmt: skip
        rho, a, n = calibration_pairs(res, g)
        if rho.shape[0] == 0:
            raise ConfigError("calibration produced no rounds; raise calibrate.max_prompts")
        sts = fit_sts(rho, a, n)
        sts.save(self.stage_dir("calibrate") / "sts.json")
        before = reliability_from_logits(rho, a, n)
        after = reliability_from_logits(rho, a, n, temperatures=sts.temperatures)
        self.log(f"  STS: ECE {before.ece_summary:.4f} -> {after.ece_summary:.4f}")
        return {
            "rounds": int(rho.shape[0]),
            "temperatures": list(map(float, sts.temperatures)),
            "ece_before": before.ece_summary,
            "ece_after": after.ece_summary,
        }

    def _stage_evaluate(self):
        from dspark_jax.eval import offline
        from dspark_jax.train.data import encode_prompt

        e = self.cfg.evaluate
        tok = self.tokenizer()
        tcfg, tparams = self.target()
        sets = self.eval_sets()
        stop = self.stop_ids()
        datasets = {}
        for name, (dom, turns) in sets.items():
            toks = [tuple(encode_prompt(tok, t[0]).tolist()) for t in turns]
            limit = self.max_prompt_len(e.max_new_tokens)
            kept = tuple(t for t in toks if len(t) <= limit)
            if len(kept) < len(toks):
                self.log(
                    f"  {name}: {len(toks) - len(kept)} prompts longer than {limit} tokens "
                    "skipped (raise evaluate.max_len)"
                )
            if not kept:
                raise ConfigError(
                    f"evaluation set {name!r} has no prompt that fits; raise evaluate.max_len"
                )
            datasets[name] = offline.EvalDataset(name, dom, kept)
        domains = {k: v.domain for k, v in datasets.items()}
        per_drafter: dict[str, dict] = {}
        calib = None
        total = sum(len(v.prompts) for v in datasets.values()) * len(self.cfg.drafters.kinds)
        bar = tqdm(total=total, desc="evaluate", unit="prompt")
        all_results = {}
        for kind in self.cfg.drafters.kinds:
            dec = self.decoder(kind)
            per_drafter[kind] = {}
            for name, ds in datasets.items():
                res = offline.run_dataset(
                    dec, ds, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                    seed=e.seed, stop_ids=stop, batch_size=e.batch_size, progress=bar,
                )  # fmt: skip
                per_drafter[kind][name] = offline.summarize(res, dec.dcfg.block_size)
                all_results[(kind, name)] = res
        bar.close()
        table = offline.tau_table(per_drafter, domains)
        if "dspark" in per_drafter and (self.stage_dir("calibrate") / "sts.json").exists():
            calib = self._calibration_report(all_results, datasets)
        speed = None
        if e.speed_prompts and self.cfg.drafters.kinds:
            kind = "dspark" if "dspark" in self.cfg.drafters.kinds else self.cfg.drafters.kinds[0]
            first = next(iter(datasets.values()))
            speed = offline.speed_batch1(
                self.decoder(kind), tcfg, tparams, first.prompts[: e.speed_prompts],
                max_new_tokens=e.max_new_tokens, temperature=e.temperature, stop_ids=stop,
            )  # fmt: skip
            speed = {"drafter": kind, **speed}
        report = {
            "config": self.cfg.name,
            "datasets": {
                k: {"domain": v.domain, "prompts": len(v.prompts)} for k, v in datasets.items()
            },
            **table,
            "per_dataset": per_drafter,
            "calibration": calib,
            "speed_batch1": speed,
            "stage_seconds": self.timings,
        }
        out = self.stage_dir("evaluate")
        write_json_atomic(out / "report.json", report)
        md = offline.markdown_report(table, per_drafter, speed, calib)
        (out / "report.md").write_text(md)
        offline.plot_report(table, per_drafter, out / "tau.png")
        self.log("\n" + md)
        return {"macro": {k: v["macro"] for k, v in table["tau"].items()}}

    def _calibration_report(self, all_results, datasets):
        from dspark_jax.eval.offline import calibration_pairs
        from dspark_jax.sched.sts import STS
        from dspark_jax.spec.metrics import reliability_from_logits

        sts = STS.load(self.stage_dir("calibrate") / "sts.json")
        g = self.drafter("dspark")[0].block_size
        parts = [calibration_pairs(all_results[("dspark", name)], g) for name in datasets]
        rho = np.concatenate([p[0] for p in parts])
        a = np.concatenate([p[1] for p in parts])
        n = np.concatenate([p[2] for p in parts])
        if rho.shape[0] == 0:
            return None
        raw = reliability_from_logits(rho, a, n)
        cal = reliability_from_logits(rho, a, n, temperatures=sts.temperatures)
        rows = []
        for k in range(g):
            rows.append({
                "count": raw.count[k], "ece_raw": raw.ece[k], "ece_sts": cal.ece[k],
                "auroc": raw.auroc[k], "brier_raw": raw.brier[k], "brier_sts": cal.brier[k],
            })  # fmt: skip
        return {
            "temperatures": list(map(float, sts.temperatures)),
            "ece_raw": raw.ece_summary, "ece_sts": cal.ece_summary,
            "auroc": raw.auroc_summary, "per_position": rows,
        }  # fmt: skip


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _count(tree) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))


def stage_summary(p: Pipeline) -> str:
    rows = [f"{s}: {p.status.get(s, 'skipped')}" for s in STAGES]
    return ", ".join(rows)


__all__ = ["STAGES", "Pipeline", "stage_summary", "dataclasses"]
