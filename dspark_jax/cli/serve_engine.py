"""The `serve.py` commands that load a model: `generate`, `serve` (after `serve_http.run` has
checked its flags) and `export`; the model loading, the engine and the app behind them, and the
start-up log saying which policy, cost profile and calibration the server runs with.

Imported by `serve_http.run` and `serve.main` only once a command needs it: it imports jax, the
engine, orbax and transformers, which `serve.py --help` and `serve.py bench` never need.
"""

from __future__ import annotations

import json
import logging
import math
import time
from importlib import resources
from pathlib import Path

import jax

from dspark_jax.cli.common import report, user_errors
from dspark_jax.compat import check_gamma as check_gamma_value
from dspark_jax.compat import check_threshold, load_cost_profile
from dspark_jax.config import DRAFTER_KINDS
from dspark_jax.drafters.compat import check_fits, vocab_hash
from dspark_jax.drafters.hf import load_hf_drafter, load_hf_drafter_extras
from dspark_jax.engine.engine import EngineConfig, ServingEngine
from dspark_jax.engine.multihost import Mirror
from dspark_jax.engine.sharding import mesh_from_flag
from dspark_jax.eval.load_test import check_local
from dspark_jax.launch import init_distributed
from dspark_jax.models.hf import load_target, load_tokenizer, read_hf_config
from dspark_jax.run.rundir import RunDir
from dspark_jax.sched.cost import CostProfile
from dspark_jax.sched.sts import STS
from dspark_jax.server.app import create_app
from dspark_jax.server.run import run_server
from dspark_jax.spec.sampling import validate_sampling_params
from dspark_jax.templates import encode_prompt
from dspark_jax.train.tokenizer import special_token_ids

# package data (pyproject's package-data): copies of benchmarks/results/decode_cost{,.tiny}.json
SHIPPED_PROFILES = ("decode_cost.json", "decode_cost.tiny.json")

log = logging.getLogger("dspark.serve")


def generate(args) -> int:
    """`serve.py generate`: decode the prompts speculatively and print them with τ."""
    try:
        # the knobs and the policy's inputs are checked before any model is loaded
        validate_sampling_params(args.temperature, args.top_k, args.top_p)
        init_distributed(args.coordinator, args.num_processes, args.process_id, args.distributed)
        run = RunDir(args.run_dir, mesh=mesh_from_flag(args.mesh))
        policy = _policy(args, run)
        tok = run.tokenizer()
        prompts = [encode_prompt(tok, p).tolist() for p in args.prompt]
        dec = run.decoder_for(args.drafter, [len(p) for p in prompts], args.max_new_tokens,
                              context_window=args.drafter_context_window)  # fmt: skip
        if policy:
            name, kw = policy
            dec.set_policy(name, **kw)
        t0 = time.perf_counter()
        res = dec.generate(
            prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seeds=[args.seed + i for i in range(len(prompts))],
            stop_ids=run.stop_ids(),
        )  # fmt: skip
        dt = time.perf_counter() - t0
    except user_errors() as e:
        return report(e, args.debug)
    for p, r in zip(args.prompt, res):
        text = tok.decode(r.tokens, skip_special_tokens=True)
        tau = (sum(r.num_accepted) + len(r.num_accepted) - sum(r.eos)) / max(len(r.num_accepted), 1)
        print(
            f">>> {p}\n{text}\n[{len(r.tokens)} tokens, {len(r.num_accepted)} rounds, τ={tau:.2f}]"
        )
    print(f"[{sum(len(r.tokens) for r in res) / dt:.1f} tokens/s incl. compilation]")
    return 0


def _policy(args, run):
    """The verification policy as `(name, kwargs)` for the decoder's `set_policy`, or None for
    fixed γ (the engine's default); its inputs are checked before the decoder is built."""
    if args.policy == "fixed":
        return None
    if args.drafter != "dspark":
        raise ValueError(f"--policy {args.policy} needs confidences: use --drafter dspark")
    sts = run.sts("dspark") or STS.identity(run.config.drafters.block_size)
    if args.policy == "threshold":
        check_threshold(args.threshold, "--threshold")
        return "threshold", dict(threshold=args.threshold, sts=sts)
    cost = load_cost_profile(args.cost_profile) if args.cost_profile else run.cost_profile()
    if cost is None:
        raise ValueError(
            f"--policy dspark needs a cost profile — pass --cost-profile FILE or put one at "
            f"{run.cost_profile_path()} (benchmarks/decode_cost.py writes it)"
        )
    return "alg1", dict(cost_profile=cost, sts=sts)


def serve(args, key: str) -> int:
    """`serve.py serve` once `serve_http.run` has checked its flags: load the models, warm up, serve
    until SIGINT / SIGTERM (`key`: the API key, "" for none)."""
    try:
        check_gamma(args)
    except user_errors() as e:
        return report(e, args.debug)
    try:
        check_local(f"http://{args.host}")  # refuse to bind beyond this machine
    except ValueError:
        log.warning("binding %s: the server is reachable from other machines%s", args.host,
                    "" if key else " without an API key (--api-key / DSPARK_API_KEY)")  # fmt: skip
    try:
        several = init_distributed(args.coordinator, args.num_processes, args.process_id,
                                   args.distributed)  # fmt: skip
        app = build_app(args, key)
    except user_errors() as e:
        return report(e, args.debug)
    if several:
        return _serve_on_processes(app, args)
    if key:
        log.info("API key required on every route but /health")
    log.info("serving on http://%s:%d (Ctrl-C / SIGTERM drains and exits)", args.host, args.port)
    run_server(app, args.host, args.port, drain_timeout_s=args.drain_timeout,
               log_level=args.log_level)  # fmt: skip
    log.info("stopped")
    return 0


def _serve_on_processes(app, args) -> int:
    """A mesh over several processes: process 0 serves HTTP and leads the engine's rounds, the
    others follow them (engine.multihost) until it stops."""
    mirror = Mirror(app.state.server.engine)
    if jax.process_index() != 0:
        log.info("process %d follows process 0's rounds", jax.process_index())
        mirror.follow()
        log.info("stopped")
        return 0
    mirror.start_ticks()
    log.info("serving on http://%s:%d for %d processes (Ctrl-C / SIGTERM drains and exits)",
             args.host, args.port, jax.process_count())  # fmt: skip
    try:
        run_server(app, args.host, args.port, drain_timeout_s=args.drain_timeout,
                   log_level=args.log_level)  # fmt: skip
    finally:
        mirror.stop()
    log.info("stopped")
    return 0


def _load(args):
    """(tokenizer, stop ids, tcfg, tparams, dcfg, dparams, sts, run cost profile, name)."""
    if args.run_dir:
        if args.drafter not in DRAFTER_KINDS:
            raise ValueError(f"--drafter must be one of {DRAFTER_KINDS} with --run-dir")
        run = RunDir(args.run_dir)
        tok = run.tokenizer()
        tcfg, tparams = run.target()
        dcfg, dparams = run.drafter(args.drafter)
        cost = run.cost_profile()
        where = run.cost_profile_path()
        return (tok, run.stop_ids(), tcfg, tparams, dcfg, dparams, run.sts(args.drafter),
                cost, where, run.path.name)  # fmt: skip
    if args.drafter in DRAFTER_KINDS:
        raise ValueError("with --target, --drafter is the drafter's checkpoint directory")
    tok = load_tokenizer(args.tokenizer or args.target, require_chat_template=True)
    tcfg, tparams = load_target(args.target)
    dcfg, dparams = load_hf_drafter(args.drafter, target=tcfg)
    name = Path(args.target).resolve().name
    sts, trained_for = load_hf_drafter_extras(args.drafter)  # `serve.py export` records both
    if trained_for is not None:  # the tokenizer too: same vocabulary as the drafter learnt
        check_fits(tcfg, dcfg, trained_for=trained_for, name=name, vocab_hash=vocab_hash(tok))
    if sts is not None:
        log.info("STS calibration: %s (config.json confidence_temperatures)", args.drafter)
    stop_ids = special_token_ids(tok)["eos_ids"]
    return tok, stop_ids, tcfg, tparams, dcfg, dparams, sts, None, None, name


def export(args) -> int:
    """`serve.py export`: a run's best drafter as a Hugging Face drafter checkpoint."""
    try:
        out = RunDir(args.run_dir).export_drafter(args.drafter, args.out)
    except user_errors() as e:
        return report(e, args.debug)
    print(f"exported the {args.drafter} drafter of {args.run_dir} to {out}")
    return 0


def _cost_profile(args, run_cost, run_where, n_params: int, policy: str):
    if args.cost_profile:
        log.info("cost profile: %s (--cost-profile)", args.cost_profile)
        return load_cost_profile(args.cost_profile)
    if run_cost is not None:
        log.info("cost profile: %s (measured for this run)", run_where)
        return run_cost
    shipped = {f: json.loads(read_shipped(f)) for f in SHIPPED_PROFILES}

    def distance(f):  # the shipped profile measured on the model closest in size
        meta = shipped[f]["cost_profile"].get("meta", {})
        return abs(math.log(max(meta.get("params", 1), 1) / max(n_params, 1)))

    best = min(shipped, key=distance)
    log.warning(
        "no cost profile for this model%s: using the shipped %s, measured on another model and "
        "machine — Algorithm 1's choices may be off; measure one with benchmarks/decode_cost.py "
        "and pass --cost-profile", f" (no {run_where})" if run_where else "", best,
    )  # fmt: skip
    return CostProfile.from_dict(shipped[best])


def read_shipped(name: str) -> str:
    """The text of a cost profile shipped in dspark_jax/data (works from a wheel too)."""
    return resources.files("dspark_jax.data").joinpath(name).read_text()


def build_engine(args):
    """Load the model and build the engine (not warmed up); returns
    `(engine, tokenizer, stop_ids, model_name)`. The start-up log says which policy, cost
    profile and calibration the server runs with, and where each came from."""
    t0 = time.perf_counter()
    tok, stop_ids, tcfg, tparams, dcfg, dparams, sts, run_cost, where, name = _load(args)
    has_conf = dcfg.kind == "dspark" and bool(getattr(dcfg, "confidence_head", True))
    policy = args.policy or ("alg1" if has_conf else "fixed")
    if args.policy is None and not has_conf:
        log.info("drafter %s has no confidences: policy fixed γ=%d", dcfg.kind, dcfg.block_size)
    cost = None
    if policy in ("alg1", "async"):
        n_params = sum(x.size for x in jax.tree.leaves(tparams))
        cost = _cost_profile(args, run_cost, where, n_params, policy)
    if policy in ("alg1", "async", "threshold") and sts is None:
        log.warning("no STS calibration for this drafter: confidences are used uncalibrated")
    ctx = tcfg.max_position_embeddings
    tokens = min(args.max_len or ctx, ctx)
    if tokens < args.max_len:
        log.warning("--max-len %d capped to the target's context of %d tokens", args.max_len, ctx)
    engine = ServingEngine(
        tcfg, dcfg, tparams, dparams, num_slots=args.num_slots,
        max_len=EngineConfig.max_len_for(tokens, dcfg.block_size),
        context_window=args.drafter_context_window,
        policy=policy, gamma=args.gamma, threshold=args.threshold, cost_profile=cost,
        sts=sts, max_queue=args.max_queue, root_seed=args.seed, mesh=mesh_from_flag(args.mesh),
        kv_layout=args.kv_layout, page_size=args.page_size, num_pages=args.num_pages,
        kv_memory_gib=args.kv_memory_gb,
        prefill_tokens_per_step=args.prefill_tokens_per_step,
        device_memory_gib=args.device_memory_gib,
    )  # fmt: skip
    log.info("%s", engine.memory_plan.summary())
    if engine.pool_plan is not None:
        lengths = sorted({min(n, engine.token_limit) for n in (512, 2048, engine.token_limit)})
        log.info("%s", engine.pool_plan.summary(lengths))
    log.info("loaded %s (drafter %s, γ=%d, policy %s) in %.1f s",
             name, dcfg.kind, dcfg.block_size, policy, time.perf_counter() - t0)  # fmt: skip
    return engine, tok, stop_ids, args.model_name or name


def build_app(args, key: str):
    """`build_engine`, warm-up (every bucket compiled before the port opens), the app (`key`:
    the API key, "" for none)."""
    engine, tok, stop_ids, name = build_engine(args)
    t0 = time.perf_counter()
    engine.warmup()
    log.info("warm-up: %d compilations (%d read from the compilation cache) in %.1f s "
             "(slots %d, max_len %d tokens, token buckets %s)", engine.compilations,
             engine.compilations_from_cache, time.perf_counter() - t0, engine.num_slots,
             engine.token_limit, engine.token_buckets)  # fmt: skip
    return create_app(engine, tok, name, stop_ids=stop_ids, drain_timeout_s=args.drain_timeout,
                      api_key=key, max_body_bytes=args.max_body_bytes,
                      request_timeout_s=args.request_timeout or None)  # fmt: skip


def check_gamma(args) -> None:
    """--gamma within the block the drafter was trained with, before any model loads (the
    engine checks it again)."""
    if args.gamma is None:
        return
    if args.run_dir:
        block = RunDir(args.run_dir).config.drafters.block_size
    else:
        hf = read_hf_config(args.drafter)
        block = int(hf.get("block_size", hf.get("ttt_length", 7)))
    check_gamma_value(args.gamma, block, "--gamma")
