"""The pipeline's overall progress line: how much of the whole run is left, not only the stage's.

Each stage's work is counted in units its cost grows with (optimizer steps x sequences, prompts x
new tokens, ...) and priced at the seconds per unit that the tiny demo measured on 2 CPU cores
(`DEMO_SECONDS_PER_UNIT`, from its run's stage times). Once a stage has run, the estimate is
rescaled by this run's own pace (seconds taken / seconds predicted so far), so a faster machine,
a GPU or a larger model corrects the prices after the first stage that trains or decodes.

The prices are the demo's own small target's. A run on a checkpoint of its own (`target.path`,
e.g. the Qwen3-4B preset) has no price until one of its stages has run — the demo's CPU rates
put that preset at ~120,000 minutes — so its line says the time left is known once one has run.
"""

from __future__ import annotations

import time

# seconds per work unit, measured on the tiny demo (16 x 160 target, 2 CPU cores; the run of
# 2026-11-30 from an empty run directory with huge pages and the queue regenerate, 20.1 min);
# the units are those of `stage_work`
DEMO_SECONDS_PER_UNIT = {
    "corpus": 3.4,  # the embedded corpus (one unit)
    "tokenizer": 3.5,  # training the tokenizer (one unit)
    "target": 308.9 / (200 * 16 * 256),  # per training token
    "regenerate": 118.8 / (1248 * 128),  # per prompt answered x max_new_tokens
    "drafters": 564.0 / (3 * 300 * 8),  # per drafter x step x sequence (incl. the feature cache)
    "calibrate": 21.7 / (48 * 96),  # per prompt x max_new_tokens
    "evaluate": 184.6 / (3 * 72 * 96 * 2),  # per drafter x prompt x new token x temperature
}


def stage_work(cfg, stage: str, prompts: int | None = None) -> float:
    """The work of `stage` under `cfg` (a PipelineConfig), in `DEMO_SECONDS_PER_UNIT`'s units;
    `prompts`: how many regenerate really answered (default: its cap, the configured counts)."""
    t, d, e = cfg.target, cfg.drafters, cfg.evaluate
    if stage == "target":
        return 0.0 if t.path else float(t.train.total_steps * t.train.global_batch_size
                                        * max(t.train.seq_buckets))  # fmt: skip
    if stage == "regenerate":
        n = cfg.regenerate_prompt_cap if prompts is None else prompts
        return float(n * cfg.regenerate.max_new_tokens)
    if stage == "drafters":
        return float(len(d.kinds) * d.train.total_steps * d.train.global_batch_size)
    if stage == "calibrate":
        return float(cfg.calibrate.max_prompts * cfg.calibrate.max_new_tokens)
    if stage == "evaluate":
        temps = 1 + sum(float(x) != float(e.temperature) for x in e.temperatures)
        sets = len(cfg.data.eval_prompt_files) or 3  # the embedded corpus: three held-out sets
        return float(len(d.kinds) * sets * e.max_prompts_per_dataset * e.max_new_tokens * temps)
    return 1.0


class PipelineEta:
    """Predicted seconds per stage still to run, rescaled by the pace of the stages done."""

    def __init__(self, cfg, stages):
        self.cfg = cfg
        self.stages = list(stages)
        self.predicted = {s: stage_work(cfg, s) * DEMO_SECONDS_PER_UNIT[s] for s in self.stages}
        self.taken: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self.priced = not cfg.target.path  # the demo's prices fit its own target only

    def done(self, stage: str, seconds: float, info: dict | None = None) -> None:
        """`stage` took `seconds`; `info` (its done.json) may say how many prompts it really
        had (the configured counts are caps: the data can hold fewer), and the pace is then
        measured on that work."""
        self.taken[stage] = seconds
        if stage == "regenerate" and "prompts" in (info or {}):
            work = stage_work(self.cfg, stage, prompts=info["prompts"])
            self.predicted[stage] = work * DEMO_SECONDS_PER_UNIT[stage]

    def skipped(self, stage: str) -> None:
        self.predicted[stage] = 0.0

    def pace(self) -> float:
        """Seconds taken / seconds predicted over the stages that ran (1 before any did); the
        two short set-up stages are left out, their time says little about the machine."""
        ran = self._measured()
        if not ran:
            return 1.0
        return sum(self.taken[s] for s in ran) / sum(self.predicted[s] for s in ran)

    def _measured(self) -> list[str]:
        return [s for s in self.taken if s not in ("corpus", "tokenizer") and self.predicted[s]]

    def line(self, stage: str) -> str:
        """`[pipeline] <stage> (i/n): x min so far, about y min left in all` (or, before a run
        on its own checkpoint has timed a stage that decodes or trains, `time left known once ...`)."""
        i = self.stages.index(stage) + 1
        so_far = (time.perf_counter() - self.t0) / 60
        head = f"[pipeline] {stage} ({i}/{len(self.stages)}): {so_far:.1f} min so far, "
        if not self.priced and not self._measured():
            return head + "time left known once a stage that decodes or trains has run"
        todo = [s for s in self.stages if s not in self.taken]
        left = sum(self.predicted[s] for s in todo) * self.pace()
        return head + f"about {left / 60:.0f} min left in all"
