"""The regenerate stage's decoding: static batches (`generate(loop="device")`, each batch decodes
until its longest row ends) against continuous batching (`loop="queue"`, a row whose answer ends
takes the next prompt), on a demo run's target and training prompts, in one process.

    python benchmarks/regenerate_queue.py --run-dir runs/tiny [--prompts 128] [--reps 2]

The prompts are the first `--prompts` training prompts (system message + first user turn, the
regenerate stage's rendering), answered at the stage's temperature / top-p / top-k /
max_new_tokens with its row counts. Both programs run once before timing, then alternately;
minimum wall time. Prints ONE JSON object: `static_s`, `queue_s`, `speedup` (static / queue),
`static_steps` (sum over batches of the longest answer), `queue_steps` (decode steps the queue
loop ran), `tokens`, `tokens_equal` (the two give the same answers), `prompts`, `rows`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if __name__ == "__main__":
    from dspark_jax.hugepages import rerun_with_hugepages

    rerun_with_hugepages()  # as train.py runs the stage (dspark_jax/hugepages.py)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dspark_jax.models.generate import _HostRows, generate  # noqa: E402
from dspark_jax.models.generate_queue import run_queue  # noqa: E402
from dspark_jax.run.pipeline import Pipeline  # noqa: E402
from dspark_jax.run.regenerate_stage import _row_buckets  # noqa: E402
from dspark_jax.run.rundir import LENGTH_BUCKETS, RunDir  # noqa: E402
from dspark_jax.spec.sampling import SamplingConfig, validate_sampling_params  # noqa: E402
from dspark_jax.train.data_templates import encode_prompt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    run = RunDir(args.run_dir)
    pipe = Pipeline(dataclasses.replace(run.config, run_dir=args.run_dir), log=lambda *a, **k: None)
    c = run.config.regenerate
    tcfg, tp = run.target()
    tok = run.tokenizer()
    reqs = pipe._regen_requests()[: args.prompts]
    msgs = [([{"role": "system", "content": s}] if s else []) + [{"role": "user", "content": t[0]}]
            for s, t in reqs]  # fmt: skip
    prompts = [list(encode_prompt(tok, m)) for m in msgs]
    n = len(prompts)
    buckets = tuple(b for b in LENGTH_BUCKETS if b <= tcfg.max_position_embeddings)
    sampling = {"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k}
    kw = dict(max_new_tokens=c.max_new_tokens, sampling=sampling, stop_ids=pipe.stop_ids(),
              seeds=list(range(n)), length_buckets=buckets)  # fmt: skip
    rows = _row_buckets(c.batch_size)

    def static():
        return generate(tcfg, tp, prompts, batch_buckets=(c.batch_size,), **kw)

    def queue():
        return generate(tcfg, tp, prompts, batch_buckets=rows, loop="queue", **kw)

    out_s, out_q = static(), queue()  # compile
    times = {"static": [], "queue": []}
    for _ in range(args.reps):
        for name, fn in (("static", static), ("queue", queue)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    lens = [len(o) for o in out_s]
    static_steps = sum(max(lens[i : i + c.batch_size]) for i in range(0, n, c.batch_size))
    sp = validate_sampling_params(c.temperature, top_p=c.top_p, top_k=c.top_k)
    host = _HostRows(np.array([len(p) for p in prompts]), np.full(n, c.max_new_tokens),
                     np.arange(n, dtype=np.uint32), [np.full(n, f) for f in sp])  # fmt: skip
    stop = np.full((4,), -1, np.int32)
    stop[: len(pipe.stop_ids())] = pipe.stop_ids()
    _, queue_steps = run_queue(tcfg, tp, prompts, host, stop, jax.random.key(0),
                               SamplingConfig.for_params(sp), (rows, buckets))  # fmt: skip
    best = {k: min(v) for k, v in times.items()}
    print(json.dumps({
        "static_s": round(best["static"], 3), "queue_s": round(best["queue"], 3),
        "speedup": round(best["static"] / best["queue"], 3),
        "static_steps": static_steps, "queue_steps": queue_steps,
        "tokens": sum(lens), "tokens_equal": out_s == out_q, "prompts": n, "rows": list(rows),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
