"""Decode τ against the training metric on the same texts: where a decode's rounds start.

The drafters stage selects checkpoints by the reference's training τ: teacher forced, one block
at every anchor of a held-out text, τ_block = 1 + Σ_k Π_{i≤k} (1 − TV_i). The evaluation's τ is
measured by decoding: tokens / rounds. On the demo the two rank the drafters differently (DSpark
+8% over Eagle3 on the held-out training τ, level in the decode table), and this script shows
why, on the demo's own models, prompts and seeds (the evaluate stage's first pass, so the decode
τ below is the report's):

1. Decode every evaluation prompt with each drafter (fixed block, `evaluate.temperature`).
2. Teacher-force each drafter on the decoded texts (prompt + answer): per anchor a in the answer
   the per-slot acceptance 1 − TV(p_target, q_drafter) of the block a+1 … a+γ
   (`dspark_jax.eval.anchors`).
3. Report, per drafter and dataset:
   * ``decode_tau`` — tokens / rounds of step 1;
   * ``tf_tau_uniform`` — the training metric: mean τ_block over every anchor of the texts;
   * ``tf_tau_at_rounds`` — mean τ_block over the anchors the decode's rounds actually started
     at, split by what preceded the round (``first`` round after the prompt; ``after_full``: the
     previous round accepted every draft, its bonus token is the anchor; ``after_reject``: the
     anchor is the token resampled at a rejection), with the count of rounds of each kind;
   * ``martingale`` — exactness check of the decode: per round the accepted drafts n_r against
     Σ_{k ≤ min(n_r + 1, γ)} (1 − TV_k) teacher forced at the round's anchor (each slot's
     acceptance probability given that the slots before it were accepted, which is what the
     decode's drafter saw); their means agree within a few standard errors (``z``) when the
     serving engine drafts exactly what the training path computes.

Rounds cluster where the text is hard to draft (a rejection is followed by another round in the
same place), so the decode weights hard anchors more than the uniform training metric does.

    python benchmarks/decode_anchors.py --run-dir runs/tiny [--prompts 24]

Prints one JSON object: {drafter: {dataset: {...}}, "summary": {gain over each other drafter
under decode τ and under the uniform training metric, macro over datasets}}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
import numpy as np  # noqa: E402

from dspark_jax.eval.anchors import anchor_report  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default="runs/tiny")
    ap.add_argument(
        "--prompts",
        type=int,
        default=0,
        help="prompts per dataset (0: evaluate.max_prompts_per_dataset)",
    )
    args = ap.parse_args()
    import dataclasses

    from dspark_jax.errors import ConfigError
    from dspark_jax.eval import offline
    from dspark_jax.run.cli import report, user_errors
    from dspark_jax.run.evaluate_stage import eval_datasets, eval_decoder
    from dspark_jax.run.pipeline import Pipeline
    from dspark_jax.run.rundir import RunDir

    try:  # a wrong run directory, a missing checkpoint, no prompt that fits: one line, first
        if args.prompts < 0:
            raise ConfigError(f"--prompts {args.prompts} — give 0 (the run's own) or more")
        # the run's own configuration: the same prompts, seeds and decoders as its evaluate stage
        cfg = dataclasses.replace(RunDir(args.run_dir).config, run_dir=args.run_dir)
        p = Pipeline(cfg)
        for kind in cfg.drafters.kinds:
            p.drafter(kind)
        datasets, _ = eval_datasets(p)
    except user_errors() as err:
        return report(err)
    e = cfg.evaluate
    if args.prompts:
        datasets = {n: dataclasses.replace(ds, prompts=ds.prompts[: args.prompts])
                    for n, ds in datasets.items()}  # fmt: skip
    longest = max(len(q) for ds in datasets.values() for q in ds.prompts)
    out = {}
    for kind in cfg.drafters.kinds:
        dec = eval_decoder(p, kind, longest)
        out[kind] = {}
        for name, ds in datasets.items():
            res = offline.run_dataset(
                dec, ds, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                seed=e.seed, stop_ids=p.stop_ids(), batch_size=e.batch_size,
            )  # fmt: skip
            row = {"decode_tau": offline.summarize(res, dec.dcfg.block_size)["tau"]}
            row.update(anchor_report(*p.target(), *p.drafter(kind), ds.prompts, res))
            out[kind][name] = row
            print(f"{kind} {name}: " + json.dumps(out[kind][name]), file=sys.stderr)
    macro = {k: {m: float(np.mean([v[m] for v in out[k].values()]))
                 for m in ("decode_tau", "tf_tau_uniform", "tf_tau_at_rounds")} for k in out}  # fmt: skip
    gains = {}
    for a in out:
        for b in out:
            if a != b:
                gains[f"{a}_vs_{b}"] = {
                    m: round(macro[a][m] / macro[b][m] - 1.0, 4) for m in macro[a]
                }
    per_dataset = max(len(d.prompts) for d in datasets.values())
    out["summary"] = {"macro": macro, "gains": gains, "prompts_per_dataset": per_dataset,
                      "temperature": e.temperature,
                      "platform": f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}"}  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
