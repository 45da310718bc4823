"""The stages behind `train.py`: corpus → tokenizer → target → regenerate → drafters →
calibrate → evaluate (one `_stage_<name>` method each). Caching, cache keys and the run
directory's versions are `dspark_jax.run.staged.StagedRun`'s; loading is `RunDir`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from dspark_jax import parallel
from dspark_jax.errors import ConfigError
from dspark_jax.io import atomic_path, atomic_write, write_json_atomic, write_text_atomic
from dspark_jax.run.rundir import LENGTH_BUCKETS
from dspark_jax.run.staged import STAGES, StagedRun
from dspark_jax.run.validate import validate_mesh


class Pipeline(StagedRun):
    """The seven stages; `run_stages` (StagedRun) runs them with caching.

    Every stage that runs a model uses `cfg.mesh`: the drafters stage's Trainer, and the target,
    drafters and decoders of regeneration, calibration and evaluation (`RunDir(mesh=...)`, placed
    by `parallel.LOGICAL_RULES`). A purely data-parallel mesh of simulated CPU devices is not used
    for inference (it would only repeat the same work on every device): one device, as before.
    """

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.mesh = parallel.make_mesh(self.cfg.mesh)
        validate_mesh(self.cfg, self.mesh)  # before the first stage, not at the drafters stage
        self.rundir.mesh = self.inference_mesh()

    def inference_mesh(self):
        """The mesh of the inference stages (None: one device; see the class docstring)."""
        m = self.mesh
        model_parallel = m.shape["fsdp"] * m.shape["tensor"] > 1
        if m.size == 1 or (not model_parallel and jax.default_backend() == "cpu"):
            return None
        return m

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
        from dspark_jax.demo.corpus import build_corpus

        return build_corpus(self.stage_dir("corpus"), self.cfg.data.corpus)

    def eval_sets(self) -> dict[str, tuple[str, list[list[str]]]]:
        """dataset name -> (domain, every prompt as a list of user turns)."""
        from dspark_jax.train.data import read_prompts

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
            out[name] = (dom, [list(pr.turns) for pr in prompts])
        return out

    def fitting_prompts(self, turns: list[list[str]], max_new_tokens: int):
        """(token ids of the prompts that fit the target's context with this budget, how many
        did not, the limit). Only the first user turn is evaluated."""
        from dspark_jax.train.data_templates import encode_prompt

        tok = self.tokenizer()
        limit = self.rundir.prompt_limit(max_new_tokens, self.cfg.evaluate.max_len)
        toks = [tuple(encode_prompt(tok, t[0]).tolist()) for t in turns]
        kept = [t for t in toks if len(t) <= limit]
        return kept, len(toks) - len(kept), limit

    # -- stages ---------------------------------------------------------------------------------

    def _corpus_needed(self) -> bool:
        return any(self._needs_corpus(s) for s in STAGES)

    def _stage_corpus(self):
        if not self._corpus_needed():
            return {"skipped": "user files and checkpoints replace the embedded corpus"}
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

        files = self.corpus_files()
        tok = train_tokenizer(files.text, self.stage_dir("tokenizer"), c.tokenizer.vocab_size)
        self.rundir.set_tokenizer(tok)
        return {"vocab": len(tok)}

    def _training_conversations(self):
        from dspark_jax.train.data import read_conversations

        c = self.cfg
        paths = c.data.conversation_files
        if not paths and not c.data.tfds:
            paths = (str(self.corpus_files().train_conversations),)
        convs = []
        for p in paths:
            # a sample's own system prompt is kept (REFERENCE §1.3); see default_system_prompt
            got, stats = read_conversations(p, keep_system=True)
            self.log(f"  {stats.summary()}")
            convs += got
        if c.data.tfds:
            from dspark_jax.train.data_tfds import parse_tfds_spec, read_tfds

            name, split, field = parse_tfds_spec(c.data.tfds)
            got, stats = read_tfds(
                name, split=split, kind="auto", field=field, data_dir=c.data.tfds_data_dir or None
            )
            self.log(f"  {stats.summary()}")
            convs += got
            paths = (*paths, f"tfds:{c.data.tfds}")
        if not convs:
            raise ConfigError(f"no usable training conversations in {paths}")
        return convs

    def _stage_target(self):
        c = self.cfg
        if c.target.path:
            tcfg, _ = self.target()
            return {"source": c.target.path, "params": _count(self.target()[1])}
        from dspark_jax.models.hf import save_target_hf
        from dspark_jax.train.data_templates import RenderConfig, encode_conversations
        from dspark_jax.train.lm import train_lm

        t = c.target
        tok = self.tokenizer()
        vocab = _round_up(len(tok), t.vocab_multiple)
        tcfg = t.model.replace(vocab_size=vocab)
        convs = self._training_conversations()
        rc = RenderConfig(
            max_length=max(t.train.seq_buckets) * t.render_windows,
            min_loss_tokens=t.min_loss_tokens,
        )
        samples, _ = encode_conversations(tok, convs, rc)
        rng = np.random.default_rng(t.train.seed)
        order = rng.permutation(len(samples))
        n_held = max(1, len(samples) // t.heldout_one_in)
        held = [samples[i].input_ids for i in order[:n_held]]
        train = [samples[i].input_ids for i in order[n_held:]]
        self.log(
            f"  target: {tcfg.num_layers} layers, hidden {tcfg.hidden_size}, vocab {vocab}; "
            f"{sum(len(t) for t in train)} training tokens"
        )
        params, log = train_lm(
            tcfg, train, t.train, self.stage_dir("target"), heldout_token_lists=held
        )
        save_target_hf(tcfg, params, self.stage_dir("target") / "hf", tokenizer=tok)
        self.rundir.forget("target")
        write_json_atomic(self.stage_dir("target") / "train_log.json", log)
        return {"params": _count(params), "final": log[-1] if log else None}

    def _regen_prompts(self):
        """Training prompts (user turns) in a fixed order; the last `calibrate.max_prompts` form
        the calibration split (never used to train drafters)."""
        return [t for _, t in self._regen_requests()]

    def _regen_requests(self):
        """(the sample's own system message or None, its user turns), in `_regen_prompts` order."""
        convs = self._training_conversations()
        rng = np.random.default_rng(self.cfg.regenerate.seed)
        order = rng.permutation(len(convs))
        n = min(len(convs), self.cfg.regenerate.max_prompts + self.cfg.calibrate.max_prompts)
        out = []
        for i in order[:n]:
            m = convs[i].messages
            system = m[0].content if m and m[0].role == "system" else None
            out.append((system, list(convs[i].user_turns())))
        return out

    def default_system_prompt(self) -> str | None:
        """The template's default system prompt, inserted when a sample has none (REFERENCE
        §1.3): Qwen targets loaded from a checkpoint render "You are a helpful assistant."; the
        embedded demo's ChatML tokenizer has no default."""
        if self.cfg.target.path and self.target()[0].architecture in ("qwen3", "qwen2"):
            return "You are a helpful assistant."
        return None

    def _stage_regenerate(self):
        from dspark_jax.models.generate import generate
        from dspark_jax.train.data_templates import encode_prompt

        c = self.cfg.regenerate
        tcfg, tparams = self._regen_target()
        tok = self.tokenizer()
        requests = self._regen_requests()
        prompts = [t for _, t in requests]
        stop = self.stop_ids()
        ctx = tcfg.max_position_embeddings
        buckets = tuple(b for b in LENGTH_BUCKETS if b <= ctx)
        shard_dir = self.stage_dir("regenerate") / "shards"
        shard_dir.mkdir(parents=True, exist_ok=True)
        shard = max(c.batch_size, 1) * c.shard_batches
        # multi-process: process k regenerates shards s % n == k into <s>.p<k>.jsonl
        pi, pn = jax.process_index(), jax.process_count()
        mine = [lo for lo in range(0, len(prompts), shard) if (lo // shard) % pn == pi]
        bar = tqdm(
            total=sum(len(prompts[lo : lo + shard]) for lo in mine),
            desc="regenerate",
            unit="prompt",
        )
        written = 0
        for lo in mine:
            s = lo // shard
            path = shard_dir / (f"{s:05d}.jsonl" if pn == 1 else f"{s:05d}.p{pi}.jsonl")
            chunk = prompts[lo : lo + shard]
            if any(shard_dir.glob(f"{s:05d}.*jsonl")):  # resumed: finished before (any process)
                bar.update(len(chunk))
                written += len(chunk)
                continue
            # the sample's own system message is sent with every turn (REFERENCE §1.2)
            msgs = [
                [{"role": "system", "content": sys_}] if sys_ else []
                for sys_, _ in requests[lo : lo + shard]
            ]
            max_turns = max(len(t) for t in chunk)
            for turn in range(max_turns):  # multi-turn prompts answered turn by turn
                idx = [i for i, t in enumerate(chunk) if len(t) > turn]
                for i in idx:
                    msgs[i].append({"role": "user", "content": chunk[i][turn]})
                toks = [list(encode_prompt(tok, msgs[i])) for i in idx]
                keep = [j for j, t in enumerate(toks) if len(t) + c.max_new_tokens <= ctx]
                outs = generate(
                    tcfg, tparams, [toks[j] for j in keep], max_new_tokens=c.max_new_tokens,
                    sampling={"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k},
                    stop_ids=stop, seeds=[c.seed + lo + idx[j] for j in keep],
                    batch_buckets=(c.batch_size,), length_buckets=buckets,
                )  # fmt: skip
                for j, out in zip(keep, outs):
                    text = tok.decode([t for t in out if t not in stop], skip_special_tokens=True)
                    msgs[idx[j]].append({"role": "assistant", "content": text.strip() or "."})
            rows = [
                {"id": lo + i, "conversations": m}
                for i, m in enumerate(msgs)
                if m and m[-1]["role"] == "assistant"
            ]
            with atomic_write(path) as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
            written += len(chunk)
            bar.update(len(chunk))
        bar.close()
        if pn > 1:  # every process's shards are written before anyone reads them
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("regenerate shards written")
        return {"prompts": len(prompts)}

    def _regen_target(self):
        """The target for regeneration: the run's (on the pipeline's mesh) in a single-process
        run; with several processes each one regenerates different prompts, so each holds its
        own copy on its local devices (`parallel.local_mesh`)."""
        if jax.process_count() == 1:
            return self.target()
        if "regen_target" not in self.rundir._cache:
            from dspark_jax.models.hf import load_target

            self.rundir._cache["regen_target"] = load_target(
                self.rundir.target_path(), mesh=parallel.local_mesh(self.cfg.mesh),
                target_layer_ids=self.cfg.target.target_layer_ids or None,
            )  # fmt: skip
        return self.rundir._cache["regen_target"]

    def _regenerated(self):
        from dspark_jax.train.data import read_conversations

        convs = []
        for p in sorted((self.stage_dir("regenerate") / "shards").glob("*.jsonl")):
            got, _ = read_conversations(p, keep_system=True)
            convs += got
        c = self.cfg.calibrate
        n_cal = min(c.max_prompts, max(len(convs) // c.heldout_one_in, 1))
        return convs[: len(convs) - n_cal], convs[len(convs) - n_cal :]

    def _stage_drafters(self):
        from dspark_jax.train.data_templates import RenderConfig, encode_conversations
        from dspark_jax.train.trainer import Trainer

        d = self.cfg.drafters
        tcfg, tparams = self.target()
        tok = self.tokenizer()
        train_convs, _ = self._regenerated()
        rc = RenderConfig(
            max_length=max(d.train.seq_buckets), min_loss_tokens=d.min_loss_tokens,
            default_system_prompt=self.default_system_prompt(),
        )  # fmt: skip
        samples, stats = encode_conversations(tok, train_convs, rc)
        self.log(f"  {stats.summary()}")
        n_eval = max(d.train.global_batch_size, len(samples) // d.eval_one_in)
        eval_s, train_s = samples[:n_eval], samples[n_eval:]
        info = {}
        for kind in d.kinds:
            dcfg = self.rundir.drafter_config(kind, tcfg)
            trainer = Trainer.for_drafter(
                d.train, dcfg, tparams, train_data=train_s,
                eval_data=eval_s, run_dir=self.stage_dir("drafters") / kind,
                mesh=self.mesh, target_name=self.rundir.target_name(),
                vocab_hash=self.rundir.vocab_hash(),
            )  # fmt: skip
            self.log(f"  training {kind}: {_count(trainer.trainable)} trainable parameters")
            res = trainer.run()
            best_step, best_score = res.best_step, res.best_score
            if not (trainer.run_dir / "best").is_dir() or best_step is None:
                # fewer steps than eval_interval, or resumed after the last step: evaluate now so
                # that the stage always ends with a best checkpoint
                trainer.evaluate()
                trainer.best_ckpt.wait()
                best_step, best_score = trainer.best_step, trainer.best_score
            if best_step is None:
                raise ConfigError(
                    f"the {kind} drafter's evaluation gave no finite simulated τ, so there is no "
                    "best checkpoint — lower drafters.train.learning_rate or raise "
                    "drafters.train.total_steps"
                )
            info[kind] = {"best_step": best_step, "best_sim_tau": best_score}
        return info

    def _stage_calibrate(self):
        from dspark_jax.eval.offline import EvalDataset, calibration_pairs, run_dataset
        from dspark_jax.sched.sts import fit_sts
        from dspark_jax.spec.metrics import reliability_from_logits

        if "dspark" not in self.cfg.drafters.kinds:
            return {"skipped": "no dspark drafter"}
        c = self.cfg.calibrate
        _, cal = self._regenerated()
        turns = [list(cv.user_turns()) for cv in cal]
        kept, too_long, limit = self.fitting_prompts(turns, c.max_new_tokens)
        if not kept:
            raise ConfigError(
                f"no calibration prompt fits in {limit} tokens — raise evaluate.max_len (0 = the "
                "target's context) or lower calibrate.max_new_tokens"
            )
        prompts = tuple(kept)
        dec = self.rundir.decoder_for("dspark", [len(p) for p in prompts], c.max_new_tokens)
        g = dec.dcfg.block_size
        res = run_dataset(
            dec, EvalDataset("calibration", "mixed", prompts), max_new_tokens=c.max_new_tokens,
            temperature=self.cfg.evaluate.temperature, seed=c.seed, stop_ids=self.stop_ids(),
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
        from dspark_jax.eval import speed as evspeed
        from dspark_jax.train.data import select_prompts

        e = self.cfg.evaluate
        tcfg, tparams = self.target()
        stop = self.stop_ids()
        datasets, coverage = {}, {}
        for name, (dom, turns) in self.eval_sets().items():
            kept, too_long, limit = self.fitting_prompts(turns, e.max_new_tokens)
            sel = tuple(select_prompts(kept, e.max_prompts_per_dataset))
            coverage[name] = {
                "domain": dom, "prompts": len(sel), "available": len(turns),
                "too_long": too_long, "max_prompt_tokens": limit,
            }  # fmt: skip
            if too_long:
                self.log(
                    f"  {name}: {too_long} of {len(turns)} prompts longer than {limit} tokens "
                    "(the target's context minus the generation budget) are not evaluated"
                )
            if not sel:
                self.log(f"  {name}: no prompt fits in {limit} tokens; dataset not evaluated")
                continue
            datasets[name] = offline.EvalDataset(name, dom, sel)
        if not datasets:
            raise ConfigError(
                f"no evaluation prompt fits in the target's context minus "
                f"evaluate.max_new_tokens={e.max_new_tokens} — lower evaluate.max_new_tokens or "
                "use shorter prompts"
            )
        longest = max(len(p) for ds in datasets.values() for p in ds.prompts)
        domains = {k: v.domain for k, v in datasets.items()}
        per_drafter: dict[str, dict] = {}
        calib = None
        total = sum(len(v.prompts) for v in datasets.values()) * len(self.cfg.drafters.kinds)
        bar = tqdm(total=total, desc="evaluate", unit="prompt")
        all_results = {}
        decoders = {
            k: self.rundir.decoder_for(k, [longest], e.max_new_tokens, e.max_len)
            for k in self.cfg.drafters.kinds
        }
        for kind in self.cfg.drafters.kinds:
            dec = decoders[kind]
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
        by_temp = self._other_temperatures(decoders, datasets, domains, stop)
        speed, breakdown = None, None
        if e.speed_prompts and self.cfg.drafters.kinds:
            kind = "dspark" if "dspark" in self.cfg.drafters.kinds else self.cfg.drafters.kinds[0]
            first = next(iter(datasets.values()))
            if e.speed_reps:
                breakdown = self._speed_breakdown(first.prompts[0], table)
            self.log("  speed: plain vs speculative decoding at batch 1 (every bucket warmed)")
            speed = evspeed.measured_speedup(
                decoders[kind], tcfg, tparams, first.prompts[: e.speed_prompts],
                max_new_tokens=e.max_new_tokens, temperature=e.temperature, stop_ids=stop,
            )  # fmt: skip
            speed = {"drafter": kind, **speed}
        extra = self._analyses(all_results, datasets, domains, breakdown, table)
        report = {
            "config": self.cfg.name,
            # prompts evaluated / available / too long for the context, per dataset
            "datasets": {k: coverage[k] for k in datasets},
            "datasets_not_evaluated": {k: v for k, v in coverage.items() if k not in datasets},
            **table,
            "per_dataset": per_drafter,
            "calibration": calib,
            "tau_by_temperature": by_temp,
            "speed_batch1": speed,
            "speed_breakdown": breakdown,
            **{k: v for k, v in extra.items() if not k.startswith("_")},
            "stage_seconds": self.timings,
        }
        out = self.stage_dir("evaluate")
        write_json_atomic(out / "report.json", report)
        md = offline.markdown_report(table, per_drafter, None, calib, coverage=coverage)
        md += "\n".join(extra["_markdown"] + _temperature_lines(by_temp)
                        + evspeed.markdown_speed(breakdown, speed)) + "\n"  # fmt: skip
        write_text_atomic(out / "report.md", md)
        for name, plot in [("tau", lambda f: offline.plot_report(table, per_drafter, f)),
                           *extra["_plots"]]:  # fmt: skip
            with atomic_path(out / f"{name}.png") as tmp:
                plot(tmp)  # writes nothing (and returns False) without matplotlib
        self.log("\n" + md)
        return {"macro": {k: v["macro"] for k, v in table["tau"].items()}}

    def _other_temperatures(self, decoders, datasets, domains, stop) -> dict:
        """The τ table at each of `evaluate.temperatures` other than `evaluate.temperature`."""
        from dspark_jax.eval import offline

        e = self.cfg.evaluate
        out = {}
        for t in e.temperatures:
            if float(t) == float(e.temperature):
                continue
            per = {}
            for kind, dec in decoders.items():
                per[kind] = {}
                for name, ds in datasets.items():
                    res = offline.run_dataset(
                        dec, ds, max_new_tokens=e.max_new_tokens, temperature=float(t),
                        seed=e.seed, stop_ids=stop, batch_size=e.batch_size,
                    )  # fmt: skip
                    per[kind][name] = offline.summarize(res, dec.dcfg.block_size)
            out[f"{float(t):g}"] = offline.tau_table(per, domains)
            self.log(f"  T={float(t):g}: macro τ " + ", ".join(
                f"{k} {v['macro']:.3f}" for k, v in out[f"{float(t):g}"]["tau"].items()))  # fmt: skip
        return out

    def _speed_breakdown(self, prompt, table) -> dict:
        """The round's breakdown per drafter next to a plain decode step (eval/speed.py)."""
        from dspark_jax.eval import speed as evspeed

        e = self.cfg.evaluate
        tcfg, tparams = self.target()
        drafters = {k: self.drafter(k) for k in self.cfg.drafters.kinds}
        self.log("  speed: timing the round's components (compiled, interleaved, medians)")
        bd = evspeed.round_breakdown(
            tcfg, tparams, drafters, prompt, temperature=e.temperature, reps=e.speed_reps
        )
        return evspeed.add_ideal(bd, {k: v["macro"] for k, v in table["tau"].items()})

    def _analyses(self, all_results, datasets, domains, breakdown, table) -> dict:
        """Bootstrap intervals, θ sweep, reliability, policies (eval/analyses.py); with the
        markdown lines (`_markdown`) and the PNG writers (`_plots`)."""
        from dspark_jax.eval import analyses
        from dspark_jax.sched.cost import CostProfile

        kinds = self.cfg.drafters.kinds
        res = {k: {n: all_results[(k, n)] for n in datasets} for k in kinds}
        boot = analyses.bootstrap_tau(res, domains)
        out: dict = {"bootstrap": boot, "_markdown": [], "_plots": []}
        out["_markdown"] += analyses.markdown_bootstrap(boot, table)
        if "dspark" not in kinds:
            return out
        sts = self.rundir.sts("dspark")
        temps = None if sts is None else sts.temperatures
        pooled = [r for n in datasets for r in res["dspark"][n]]
        sweep = analyses.threshold_sweep(res["dspark"])
        rel = analyses.reliability_bins(pooled, temperatures=temps)
        cost = self.rundir.cost_profile()
        if cost is None and breakdown:
            # affine fit of the measured verify forward vs tokens (batch 1) as the cost model
            t = np.asarray([float(k) for k in breakdown["verify_forward_ms"]])
            y = np.asarray(list(breakdown["verify_forward_ms"].values())) / 1e3
            beta, alpha = np.polyfit(t, y, 1)
            cost = CostProfile.from_step_time(max(alpha, 1e-6), max(beta, 1e-9))
        pol = analyses.policy_replay(pooled, temperatures=temps, cost=cost)
        out.update(threshold_sweep=sweep, reliability=rel, policies=pol)
        out["_markdown"] += (analyses.markdown_threshold(sweep) + analyses.markdown_reliability(rel)
                             + analyses.markdown_policies(pol))  # fmt: skip
        out["_plots"] += [
            ("analyses", lambda f: analyses.plot_analyses(sweep, pol, f)),
            ("reliability", lambda f: analyses.plot_reliability(rel, f)),
        ]
        return out

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


def _temperature_lines(by_temp: dict) -> list[str]:
    lines = []
    for t, tab in by_temp.items():
        lines += ["", f"## τ at temperature {t} (same prompts, fixed block)", ""]
        lines.append("| drafter | " + " | ".join(next(iter(tab["tau"].values()))["domains"])
                     + " | macro |")  # fmt: skip
        lines.append("|---" * (len(next(iter(tab["tau"].values()))["domains"]) + 2) + "|")
        for d, row in tab["tau"].items():
            cells = [f"{v:.3f}" for v in row["domains"].values()]
            lines.append(f"| {d} | " + " | ".join(cells) + f" | **{row['macro']:.3f}** |")
    return lines


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _count(tree) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))


def stage_summary(p: Pipeline) -> str:
    rows = [f"{s}: {p.status.get(s, 'skipped')}" for s in STAGES]
    return ", ".join(rows)


__all__ = ["STAGES", "Pipeline", "stage_summary"]
