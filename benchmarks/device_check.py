"""First run on an accelerator: parity tests, one short drafter training, the serving frontier.

    python benchmarks/device_check.py [--out benchmarks/results/device_check.json] [--reduced]
    python benchmarks/device_check.py --smoke   # seconds: the same steps and keys at the
                                                # smallest sizes, parity skipped (the test suite
                                                # runs those tests), JSON to a temporary file

On a GPU or TPU (a few minutes):

1. parity: the HF-parity, greedy-speculative == greedy and lossless-sampling tests run under
   pytest on the accelerator (`JAX_PLATFORMS` set to the backend; the suite's conftest would
   otherwise pick the CPU), pass/fail counts and seconds recorded;
2. train: a DSpark drafter for the ~30M-parameter `small_target_config` target (random
   weights) trained for `--steps` steps on sequences the target generated itself (greedy from
   random prompts), bf16 compute; tokens/s, first/last loss, the trainer's memory plan and
   XLA's compiled memory analysis of the micro-step;
3. serve: the serving frontier of that pair: plain greedy `generate` tokens/s (the baseline, in
   the same run) and speculative greedy decoding with verification lengths 1..γ at batch 1 and
   8: tokens/s, mean accepted drafts per round and the speed-up over the baseline;
4. round: the batch-1 round's parts at T = 1 next to a plain decode step (`eval/speed.py`):
   drafting's share of a round, host-scheduled and with 16 device-resident rounds per call
   (the accelerator goal: drafting <= 15% of the resident round).

On CPU the same steps run reduced (tiny target, a few steps, batch 1, fewer tests) and the JSON
says `"reduced": true` with the reason: CPU numbers are not accelerator figures.

Prints the JSON object and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: the parity tests run from it

PARITY_FULL = [
    "tests/test_hf_parity.py",
    "tests/test_engine.py",
    "tests/test_engine_sampled.py",
    "tests/test_lossless.py",
]
PARITY_REDUCED = ["tests/test_engine.py::test_greedy_equals_plain_decoding_every_policy"]


def run_parity(backend: str, reduced: bool, timeout: int) -> dict:
    files = PARITY_REDUCED if reduced else PARITY_FULL
    env = dict(os.environ, JAX_PLATFORMS={"gpu": "cuda"}.get(backend, backend))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        tail, rc = (p.stdout + p.stderr).strip().splitlines()[-1:], p.returncode
    except subprocess.TimeoutExpired:
        tail, rc = [f"timed out after {timeout} s"], -1
    return {
        "tests": files,
        "returncode": rc,
        "ok": rc == 0,
        "summary": tail[0] if tail else "",
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _self_generated(tcfg, tparams, n: int, prompt: int, new: int, seed: int = 0):
    """`n` sequences the target wrote itself (greedy), the last `new` tokens supervised."""
    import numpy as np

    from dspark_jax.models.generate import generate
    from dspark_jax.train.data import TokenizedSample

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, tcfg.vocab_size, prompt).tolist() for _ in range(n)]
    outs = generate(tcfg, tparams, prompts, max_new_tokens=new, length_buckets=(prompt + new,))
    samples = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ids = np.asarray(p + list(o), np.int32)
        mask = np.zeros(len(ids), np.uint8)
        mask[len(p) :] = 1
        samples.append(TokenizedSample(ids, mask, id=i))
    return prompts, samples


def run_train(tcfg, tparams, dcfg, args, run_dir: Path) -> tuple[dict, object]:
    from dspark_jax.config import TrainConfig
    from dspark_jax.train.trainer import Trainer

    _, samples = _self_generated(tcfg, tparams, args.sequences, 16, args.seq_len - 16)
    cfg = TrainConfig(
        total_steps=args.steps,
        global_batch_size=args.batch,
        micro_batch_size=args.batch,
        seq_buckets=(args.seq_len,),
        learning_rate=3e-3,
        warmup_ratio=0.1,
        eval_interval=0,
        checkpoint_interval=0,
        log_interval=max(args.steps // 4, 1),
        progress_bar=False,
        memory_check="compiled",
    )
    mesh = None
    if args.smoke:  # one device (a mesh of all would need a batch per device)
        import jax

        from dspark_jax import parallel
        from dspark_jax.config import MeshConfig

        mesh = parallel.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    t = Trainer.for_drafter(cfg, dcfg, tparams, train_data=samples, run_dir=run_dir, resume=False,
                            mesh=mesh)  # fmt: skip
    warm = t.run(max_steps=1, save_at_end=False)  # compiles
    res = t.run(save_at_end=False)
    t.close()
    losses = [h["loss"] for h in warm.history + res.history]
    out = {
        "compute_dtype": t.cfg.compute_dtype,
        "steps": t.step,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "tokens_per_s": round(res.tokens / max(res.seconds, 1e-9), 1),
        "memory_plan": t.memory_plan.to_json(),
        "compiled_memory": t.compiled_memory,
    }
    from dspark_jax.drafters.common import DrafterParams

    return out, DrafterParams(t.trainable, t.frozen)


def run_serve(tcfg, tparams, dcfg, dparams, args) -> dict:
    import numpy as np

    from dspark_jax.engine import ServingEngine
    from dspark_jax.models.generate import generate

    rng = np.random.default_rng(1)
    new = args.new_tokens
    out: dict = {"new_tokens": new, "rows": []}
    for b in args.serve_batches:
        prompts = [rng.integers(0, tcfg.vocab_size, 16).tolist() for _ in range(b)]
        dec = ServingEngine(tcfg, dcfg, tparams, dparams, num_slots=b, max_len=16 + new + 2 * dcfg.block_size + 8, prompt_buckets=(16,), modes=("greedy",))  # fmt: skip
        dec.warmup()

        def timed(fn):
            fn()  # compile
            t0 = time.perf_counter()
            r = fn()
            return r, time.perf_counter() - t0

        def plain(prompts=prompts):
            return generate(tcfg, tparams, prompts, max_new_tokens=new, length_buckets=(16 + new,))

        base, dt = timed(plain)
        base_tps = b * new / dt
        out["rows"].append({"batch": b, "verify_len": 0, "tokens_per_s": round(base_tps, 1)})
        for n in args.verify_lens or range(1, dcfg.block_size + 1):

            def spec(prompts=prompts, n=n, dec=dec):
                dec.set_policy("fixed", gamma=n)
                return dec.generate(prompts, max_new_tokens=new, temperature=0.0)

            res, dt = timed(spec)
            toks = sum(len(r.tokens) for r in res)
            acc = [a for r in res for a in r.num_accepted]
            same = [r.tokens for r in res] == [list(x)[: len(r.tokens)] for x, r in zip(base, res)]
            out["rows"].append(
                {
                    "batch": b,
                    "verify_len": n,
                    "tokens_per_s": round(toks / dt, 1),
                    "speedup": round(toks / dt / base_tps, 3),
                    "mean_accepted": round(float(np.mean(acc)), 3) if acc else 0.0,
                    "greedy_equal": same,
                }
            )
    return out


def run_round(tcfg, tparams, dcfg, dparams, args) -> dict:
    """The round's parts at batch 1 (eval/speed.round_breakdown, T = 1): drafting's share of a
    host-scheduled round and of a round with 16 device-resident rounds per call; the goal is
    drafting <= 15% of the resident round."""
    import numpy as np

    from dspark_jax.eval.speed import round_breakdown

    prompt = np.random.default_rng(2).integers(0, tcfg.vocab_size, 16).tolist()
    bd = round_breakdown(
        tcfg, tparams, {"dspark": (dcfg, dparams)}, prompt, temperature=1.0,
        reps=args.round_reps, resident_rounds=args.resident_rounds, **args.round_kw,
    )  # fmt: skip
    row, res = bd["drafters"]["dspark"], bd.get("resident") or {}
    share = res.get("draft_share_of_round")
    return {
        "step_ms": round(bd["step_ms"], 4),
        "verify_in_steps": {str(k): round(v, 3) for k, v in bd["verify_forward_in_steps"].items()},
        "draft_ms": round(row["draft_ms"], 4),
        "round_ms": round(row["round_ms"], 4),
        "draft_share_of_round": round(row["draft_share_of_round"], 4),
        "resident_round_ms": round(res["round_ms"], 4) if res else None,
        "resident_draft_share_of_round": None if share is None else round(share, 4),
        "resident_host_share_of_round": round(res["host_share_of_round"], 4) if res else None,
        "draft_share_goal": 0.15,
        "draft_share_goal_met": None if share is None else bool(share <= 0.15),
        "compilations_during_timing": bd["compilations_during_timing"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--reduced", action="store_true", help="the CPU-sized run on any backend")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--parity-timeout", type=int, default=300)
    ap.add_argument("--smoke", action="store_true", help="seconds-sized run, the same keys")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reduced = True
        args.out = args.out or os.path.join(tempfile.mkdtemp(prefix="device_check_"), "out.json")
    args.out = args.out or "benchmarks/results/device_check.json"
    args.resident_rounds, args.round_kw = 16, {}

    import jax

    backend = jax.default_backend()
    reduced = args.reduced or backend == "cpu"
    why = None
    if reduced:
        why = "no GPU/TPU: tiny target, few steps" if backend == "cpu" else "--reduced"
    from dspark_jax.config import DrafterConfig
    from dspark_jax.models import transformer
    from dspark_jax.testing import (
        small_target_config,
        smoke_drafter_config,
        smoke_models,
        tiny_target_config,
    )

    if args.smoke:
        tcfg = tiny_target_config()
        args.steps, args.batch, args.seq_len, args.sequences = 2, 2, 32, 4
        args.new_tokens, args.serve_batches, args.verify_lens = 8, [1], [2]
        args.round_reps, args.resident_rounds = 1, 2
        args.round_kw = {"verify_tokens": (1,)}  # and γ + 1
        dkw = None  # testing.smoke_drafter_config
        why = "--smoke: the smallest sizes, parity skipped"
    elif reduced:
        tcfg = tiny_target_config()
        args.steps, args.batch, args.seq_len, args.sequences = 4, 4, 64, 16
        args.new_tokens, args.serve_batches, args.verify_lens = 32, [1], [4]
        args.round_reps = 2
        dkw = dict(num_layers=1, block_size=4, num_anchors=16, markov_rank=16)
    else:
        tcfg = small_target_config()
        args.steps, args.batch, args.seq_len, args.sequences = 60, 16, 256, 256
        args.new_tokens, args.serve_batches, args.verify_lens = 128, [1, 8], None
        args.round_reps = 7
        dkw = dict(num_layers=2, block_size=7, num_anchors=64, markov_rank=64)
    if dkw is None:
        dcfg = smoke_drafter_config(tcfg)
    else:
        dcfg = DrafterConfig.dspark(tcfg, mask_token_id=tcfg.vocab_size - 1, **dkw)
    result: dict = {
        "backend": backend,
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "reduced": reduced,
        "why_reduced": why,
        "target": {"hidden": tcfg.hidden_size, "layers": tcfg.num_layers, "vocab": tcfg.vocab_size},
    }
    t0 = time.perf_counter()
    if args.smoke:
        result["parity"] = {"skipped": "--smoke (the test suite runs the parity tests)"}
    elif not args.skip_parity:
        result["parity"] = run_parity(backend, reduced, args.parity_timeout)
    # smoke: testing.smoke_models' target (its programs shared with the other smoke runs')
    tparams = smoke_models()[1] if args.smoke else transformer.init_params(tcfg, 0)

    with tempfile.TemporaryDirectory() as d:
        result["train"], dparams = run_train(tcfg, tparams, dcfg, args, Path(d) / "run")
    dparams = jax.device_put(jax.device_get(dparams))  # off the training mesh: one device
    result["serve"] = run_serve(tcfg, tparams, dcfg, dparams, args)
    result["round"] = run_round(tcfg, tparams, dcfg, dparams, args)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main().get("parity", {}).get("ok", True) else 1)
