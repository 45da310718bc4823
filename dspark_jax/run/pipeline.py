"""The stages behind `train.py`: corpus → tokenizer → target → regenerate → drafters →
calibrate → evaluate (one `_stage_<name>` method each; the longest bodies are in
`run/regenerate_stage.py`, `run/drafters_stage.py` and `run/evaluate_stage.py`). Caching, cache
keys and the run directory's versions are `dspark_jax.run.staged.StagedRun`'s; loading is `RunDir`'s.

`train.py` imports this module once the configuration is checked (cli/train.py); with jax, the
engine and the runs' modules loaded by then, the trainers and the evaluation add 0.5-0.8 s
(python -X importtime, 2-core machine), so they are imported here at the top.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from dspark_jax import parallel
from dspark_jax.demo.corpus import build_corpus
from dspark_jax.errors import ConfigError
from dspark_jax.eval.offline import EvalDataset, calibration_pairs, run_dataset
from dspark_jax.io import write_json_atomic
from dspark_jax.models.hf import save_target_hf
from dspark_jax.models.transformer import param_count
from dspark_jax.run import drafters_stage, evaluate_stage, regenerate_stage
from dspark_jax.run.staged import STAGES, StagedRun
from dspark_jax.run.validate_inputs import validate_mesh
from dspark_jax.sched.sts import fit_sts
from dspark_jax.spec.metrics import reliability_from_logits
from dspark_jax.templates import RenderConfig, encode_prompt
from dspark_jax.train.data import (
    count_jsonl_rows,
    encode_conversations,
    process_block,
    read_conversation_block,
    read_conversation_rows,
    read_conversations,
    read_prompts,
)
from dspark_jax.train.data_tfds import count_tfds_examples, parse_tfds_spec, read_tfds
from dspark_jax.train.host_data import HostTable, per_host_layout
from dspark_jax.train.lm import train_lm
from dspark_jax.train.tokenizer import train_tokenizer


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
        self.rundir.mesh = self.inference_mesh()

    def run_stages(self, stages=STAGES, *, force=()):
        if "drafters" in stages:  # before the first stage, not when the drafters stage starts
            validate_mesh(self.cfg, self.mesh)
        return super().run_stages(stages, force=force)

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
        return build_corpus(self.stage_dir("corpus"), self.cfg.data.corpus)

    def eval_sets(self) -> dict[str, tuple[str, list[list[str]]]]:
        """dataset name -> (domain, every prompt as a list of user turns)."""
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

        files = self.corpus_files()
        tok = train_tokenizer(files.text, self.stage_dir("tokenizer"), c.tokenizer.vocab_size)
        self.rundir.set_tokenizer(tok)
        return {"vocab": len(tok)}

    def _training_conversations(self):
        convs = [cv for got in self._training_sources() for cv in got]
        if not convs:
            raise ConfigError(f"no usable training conversations in {self._training_paths()}")
        return convs

    def _training_paths(self) -> tuple[str, ...]:
        c = self.cfg
        paths = c.data.conversation_files
        if not paths and not c.data.tfds:
            paths = (str(self.corpus_files().train_conversations),)
        return (*paths, f"tfds:{c.data.tfds}") if c.data.tfds else tuple(paths)

    def _training_sources(self, shard=None) -> list[list]:
        """The training conversations of each source (files, then the TFDS split); with
        `shard=(k, P)` only process k's block of each source's rows (`data.process_block`)."""
        c = self.cfg
        out = []
        for p in self._training_paths():
            if p.startswith("tfds:"):
                name, split, field = parse_tfds_spec(c.data.tfds)
                got, stats = read_tfds(name, split=split, kind="auto", field=field,
                                       data_dir=c.data.tfds_data_dir or None, shard=shard)  # fmt: skip
            else:
                # a sample's own system prompt is kept (docs/METHOD.md §1.3);
                # see default_system_prompt
                got, stats = read_conversations(p, keep_system=True, shard=shard)
            self.log(f"  {stats.summary()}")
            out.append(got)
        return out

    def _per_host(self) -> bool:
        """Whether this run reads per host (issue 40): several processes, laid along the mesh's
        data / fsdp axes (`host_data.per_host_layout`); else every process reads everything."""
        if jax.process_count() == 1:
            return False

        return per_host_layout(self.mesh)

    def _stage_target(self):
        c = self.cfg
        if c.target.path:
            tcfg, _ = self.target()
            return {"source": c.target.path, "params": param_count(self.target()[1])}

        t = c.target
        tok = self.tokenizer()
        vocab = _round_up(len(tok), t.vocab_multiple)
        tcfg = t.model.replace(vocab_size=vocab)
        rc = RenderConfig(
            max_length=max(t.train.seq_buckets) * t.render_windows,
            min_loss_tokens=t.min_loss_tokens,
        )
        if self._per_host():
            held, train, n_tokens = self._target_windows(tok, rc)
        else:
            samples, _ = encode_conversations(tok, self._training_conversations(), rc)
            rng = np.random.default_rng(t.train.seed)
            order = rng.permutation(len(samples))
            n_held = max(1, len(samples) // t.heldout_one_in)
            held = [samples[i].input_ids for i in order[:n_held]]
            train = [samples[i].input_ids for i in order[n_held:]]
            n_tokens = sum(len(t) for t in train)
        self.log(
            f"  target: {tcfg.num_layers} layers, hidden {tcfg.hidden_size}, vocab {vocab}; "
            f"{n_tokens} training tokens"
        )
        params, log = train_lm(  # its checkpoints: in the bucket for a bucket run directory
            tcfg, train, t.train, self.durable_dir("target"), heldout_token_lists=held
        )
        save_target_hf(tcfg, params, self.stage_dir("target") / "hf", tokenizer=tok)
        self.rundir.forget("target")
        write_json_atomic(self.stage_dir("target") / "train_log.json", log)
        return {"params": param_count(params), "final": log[-1] if log else None}

    def _target_windows(self, tok, rc):
        """(held-out, training) windows and the training tokens of a per-host run: this process
        reads and tokenizes only its block of each source; the windows are the one-process
        run's (`host_data.HostTable`)."""
        t = self.cfg.target
        shard = (jax.process_index(), jax.process_count())
        sources = [encode_conversations(tok, got, rc)[0]
                   for got in self._training_sources(shard)]  # fmt: skip
        table = HostTable.of(self.mesh, sources)
        if not table.size:
            raise ConfigError(f"no usable training conversations in {self._training_paths()}")
        order = np.random.default_rng(t.train.seed).permutation(table.size)
        n_held = max(1, table.size // t.heldout_one_in)
        seq_len = max(t.train.seq_buckets)
        train = table.windows(order[n_held:], seq_len)
        return table.windows(order[:n_held], seq_len), train, int(train.ends[-1])

    def _source_rows(self) -> list[int]:
        """The rows of each training source (files, then the TFDS split), counted without
        parsing them."""
        out = []
        for p in self._training_paths():
            if p.startswith("tfds:"):
                name, split, _ = parse_tfds_spec(self.cfg.data.tfds)
                out.append(count_tfds_examples(name, split, self.cfg.data.tfds_data_dir or None))
            else:
                out.append(count_jsonl_rows(p))
        return out

    def _regen_order(self) -> np.ndarray:
        """The training rows regenerate answers (indices over every source's rows in turn), in
        a fixed order: a permutation, capped at `regenerate_prompt_cap`; the last
        `calibrate.max_prompts` form the calibration split (never used to train drafters)."""
        total = sum(self._source_rows())
        if not total:
            raise ConfigError(f"no training conversations in {self._training_paths()}")
        order = np.random.default_rng(self.cfg.regenerate.seed).permutation(total)
        return order[: min(total, self.cfg.regenerate_prompt_cap)]

    def _regen_requests(self, rows) -> dict[int, tuple]:
        """{row: (the sample's own system message or None, its user turns)} of the rows `rows`
        (indices as `_regen_order`'s) that hold a valid conversation; only those rows are read,
        so each process reads the rows of its own shards."""
        c, out, lo = self.cfg, {}, 0
        wanted = np.sort(np.asarray(rows, np.int64))
        for path, n in zip(self._training_paths(), self._source_rows()):
            mine = (wanted[(wanted >= lo) & (wanted < lo + n)] - lo).tolist()
            if path.startswith("tfds:") and mine:
                name, split, field = parse_tfds_spec(c.data.tfds)
                got, _ = read_tfds(name, split=split, kind="auto", field=field, rows=mine,
                                   data_dir=c.data.tfds_data_dir or None)  # fmt: skip
                got = [(cv.id, cv) for cv in got]  # a TFDS conversation's id: its index
            elif mine:
                got, _ = read_conversation_rows(path, mine, keep_system=True)
            else:
                got = []
            for r, cv in got:
                m = cv.messages
                system = m[0].content if m and m[0].role == "system" else None
                out[lo + int(r)] = (system, list(cv.user_turns()))
            lo += n
        return out

    def render_config(self, **kw) -> RenderConfig:
        """How drafters' training conversations are rendered (docs/METHOD.md §1.3), by the target:
        a Qwen checkpoint inserts the default system prompt "You are a helpful assistant.", a
        Gemma 4 checkpoint renders `<|turn>model` turns whose empty thought channel the loss
        skips; the embedded demo's ChatML tokenizer has neither (`RenderConfig.for_target`)."""
        arch = self.target()[0].architecture if self.cfg.target.path else None
        return RenderConfig.for_target(arch, **kw)

    def _stage_regenerate(self):
        return regenerate_stage.run_regenerate(self)

    def _regenerated_files(self) -> list[Path]:
        return sorted((self.stage_dir("regenerate") / "shards").glob("*.jsonl"))

    def _calibration_count(self, n: int) -> int:
        c = self.cfg.calibrate
        return min(c.max_prompts, max(n // c.heldout_one_in, 1))

    def _regenerated(self):
        convs = []
        for p in self._regenerated_files():
            got, _ = read_conversations(p, keep_system=True)
            convs += got
        n_cal = self._calibration_count(len(convs))
        return convs[: len(convs) - n_cal], convs[len(convs) - n_cal :]

    def _regenerated_block(self):
        """This process's block (`data.process_block`) of the drafters' training conversations
        (those `_regenerated` gives): only its rows are read. Every regenerated row is a valid
        conversation (the stage writes none other), so rows count as conversations."""
        files = self._regenerated_files()
        counts = [count_jsonl_rows(p) for p in files]
        n = sum(counts)
        block = process_block(n - self._calibration_count(n), jax.process_index(),
                              jax.process_count())  # fmt: skip
        convs, stats = read_conversation_block(files, block, keep_system=True, counts=counts)
        if stats.kept != stats.read:
            raise ConfigError(f"regenerated conversations were dropped ({stats.summary()}); "
                              "re-run the regenerate stage (--force regenerate)")  # fmt: skip
        return convs

    def _stage_drafters(self):
        return drafters_stage.run_drafters(self)

    def calibration_prompts(self) -> tuple:
        """The calibration split's prompts (the last regenerated conversations: no drafter trains
        on them, and they are not the evaluation prompts), those that fit with
        `calibrate.max_new_tokens`; a ConfigError when none does."""
        files = self._regenerated_files()  # only the calibration split's rows are read
        counts = [count_jsonl_rows(f) for f in files]
        n = sum(counts)
        cal, _ = read_conversation_block(files, range(n - self._calibration_count(n), n),
                                         keep_system=True, counts=counts)  # fmt: skip
        turns = [list(cv.user_turns()) for cv in cal]
        kept, _, limit = self.fitting_prompts(turns, self.cfg.calibrate.max_new_tokens)
        if not kept:
            raise ConfigError(
                f"no calibration prompt fits in {limit} tokens — raise evaluate.max_len (0 = the "
                "target's context) or lower calibrate.max_new_tokens"
            )
        return tuple(kept)

    def decode_calibration(self, kind: str, prompts, seeds):
        """Decode `prompts` with drafter `kind` as the calibrate stage does (fixed block, the
        evaluation temperature, one lean decoder) once per seed: ([results per seed], γ)."""
        c, e = self.cfg.calibrate, self.cfg.evaluate
        dec = self.rundir.decoder_for(kind, [len(p) for p in prompts], c.max_new_tokens, lean=True)
        ds = EvalDataset("calibration", "mixed", tuple(prompts))
        kw = dict(max_new_tokens=c.max_new_tokens, temperature=e.temperature,
                  stop_ids=self.stop_ids(), batch_size=e.batch_size)  # fmt: skip
        return [run_dataset(dec, ds, seed=seed, **kw) for seed in seeds], dec.dcfg.block_size

    def _stage_calibrate(self):
        if "dspark" not in self.cfg.drafters.kinds:
            return {"skipped": "no dspark drafter"}
        c = self.cfg.calibrate
        (res,), g = self.decode_calibration("dspark", self.calibration_prompts(), [c.seed])
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
        return evaluate_stage.run_evaluate(self)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def stage_summary(p: Pipeline) -> str:
    rows = [f"{s}: {p.status.get(s, 'skipped')}" for s in STAGES]
    return ", ".join(rows)


__all__ = ["STAGES", "Pipeline", "stage_summary"]
