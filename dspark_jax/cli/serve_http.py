"""`serve.py serve`, `bench` and `export`: arguments, model loading and the start-up log.

    python serve.py serve --run-dir runs/tiny [--host 127.0.0.1 --port 8000]
    python serve.py serve --target ckpt/Qwen3-0.6B --drafter ckpt/dspark-qwen3 --policy alg1
    python serve.py bench --url http://127.0.0.1:8000 --requests 1000
    python serve.py export --run-dir runs/tiny --drafter dspark --out ckpt/dspark-tiny

Speculative knobs are fixed per server at start-up: the drafter, the verification policy
(default Algorithm 1, `alg1`, on DSpark's STS-calibrated confidences) and its cost profile
(`--cost-profile`, else the run's `cost_profile.json`, else a profile shipped with the package:
dspark_jax/data/decode_cost*.json, the one measured on the model closest in size, with a warning
in the log that it was measured on another model).

Imports of engine/, run/, drafters/ and models.hf (jax, transformers, orbax) sit inside the
functions that use them, on purpose: each costs 1.2-2.5 s to import on the 2-core machine
(measured), and `serve.py bench` (an HTTP client) never needs them.
"""

from __future__ import annotations

import json
import logging
import math
import time
from importlib import resources
from pathlib import Path

from dspark_jax.cli import bench
from dspark_jax.cli.common import report, user_errors
from dspark_jax.eval.load_test import check_local
from dspark_jax.launch import add_distributed_flags, init_distributed

DRAFTER_KINDS = ("dspark", "dflash", "eagle3")
POLICIES = ("alg1", "async", "threshold", "fixed", "mtp1")
# package data (pyproject's package-data): copies of benchmarks/results/decode_cost{,.tiny}.json
SHIPPED_PROFILES = ("decode_cost.json", "decode_cost.tiny.json")

log = logging.getLogger("dspark.serve")


def add_subcommands(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a run directory written by train.py")
    src.add_argument("--target", help="a Hugging Face target checkpoint directory")
    s.add_argument("--drafter", default="dspark",
                   help="with --run-dir: dspark | dflash | eagle3; with --target: the drafter "
                        "checkpoint directory")  # fmt: skip
    s.add_argument("--tokenizer", default="", help="with --target (default: the target's dir)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model-name", default="", help="the `model` clients send (default: dir name)")
    s.add_argument("--policy", default=None, choices=POLICIES,
                   help="verification lengths (default alg1 = Algorithm 1; fixed for drafters "
                        "without confidences)")  # fmt: skip
    s.add_argument("--gamma", type=int, default=None, help="fixed policy: drafts verified")
    s.add_argument("--threshold", type=float, default=0.5, help="threshold policy")
    s.add_argument("--cost-profile", default="", help="decode_cost.py JSON for alg1 / async")
    s.add_argument("--num-slots", type=int, default=8, help="concurrent requests on the device")
    s.add_argument("--max-len", type=int, default=0,
                   help="prompt + completion tokens of a request, max (0: the target's context; "
                        "the slots layout reserves --num-slots x this many positions)")  # fmt: skip
    s.add_argument("--drafter-context-window", type=int, default=None, metavar="W",
                   help="DSpark/DFlash: draft from the last W context positions only (default: "
                        "the window the drafter was trained with; may narrow it, not widen)")  # fmt: skip
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    s.add_argument("--kv-layout", default="slots", choices=("slots", "paged"),
                   help="paged: K/V in a pool of pages, admission by free pages, preemption by "
                        "recompute (on one device or a --mesh)")  # fmt: skip
    s.add_argument("--page-size", type=int, default=16, help="with --kv-layout paged")
    s.add_argument("--num-pages", type=int, default=0,
                   help="with --kv-layout paged (0: as many positions as --num-slots x --max-len)")  # fmt: skip
    s.add_argument("--device-memory-gib", type=float, default=0.0,
                   help="the devices' memory for the engine's plan (0: as they report; CPUs "
                        "report none); an engine that cannot fit is refused before its KV cache is created")  # fmt: skip
    s.add_argument("--prefill-tokens-per-step", type=int, default=0,
                   help="prompt tokens prefilled per engine step (whole 512-token chunks, at "
                        "least one; 0: no bound): a long prompt is prefilled over several "
                        "steps while running requests keep decoding")  # fmt: skip
    s.add_argument("--seed", type=int, default=0, help="root seed of the engine's sampling")
    s.add_argument("--mesh", default="", metavar="DATA,FSDP,TENSOR",
                   help="device mesh, e.g. 1,1,8 = tensor parallel over 8 devices (default: all "
                        "accelerator devices data parallel; one device on CPU)")  # fmt: skip
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM: seconds open requests may take to finish")  # fmt: skip
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $DSPARK_API_KEY; unset: no authentication)")  # fmt: skip
    s.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="larger request bodies are refused with 413 (default 4 MiB)")  # fmt: skip
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take from arrival (queue included) before it is "
                        "cancelled and answered 504; 0: no limit")  # fmt: skip
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    add_distributed_flags(s)  # process 0 serves HTTP, the others follow its rounds

    b = sub.add_parser("bench", help="load test (or --duration soak) of a server on 127.0.0.1")
    bench.add_arguments(b)

    e = sub.add_parser("export", help="a run's best drafter as a Hugging Face drafter checkpoint")
    e.add_argument("--run-dir", required=True, help="a run directory written by train.py")
    e.add_argument("--drafter", default="dspark", choices=DRAFTER_KINDS)
    e.add_argument("--out", required=True, help="a new (or empty) directory to write")
    e.add_argument("--debug", action="store_true", help="show tracebacks of errors")


def run(args) -> int:
    """Dispatch `serve` / `bench` (argparse namespace from `add_subcommands`)."""
    if args.cmd == "bench":
        return bench.run_cli(args)
    if args.cmd == "export":
        return export(args)
    # our start-up lines at --log-level; other libraries' (absl, orbax) at WARNING
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(args.log_level.upper())
    try:
        check_limits(args)
        check_settings(args)
    except user_errors() as e:
        return report(e, args.debug)
    key = api_key(args)
    try:
        check_local(f"http://{args.host}")  # refuse to bind beyond this machine
    except ValueError:
        log.warning("binding %s: the server is reachable from other machines%s", args.host,
                    "" if key else " without an API key (--api-key / DSPARK_API_KEY)")  # fmt: skip
    try:
        several = init_distributed(args.coordinator, args.num_processes, args.process_id,
                                   args.distributed)  # fmt: skip
        app = build_app(args)
    except user_errors() as e:
        return report(e, args.debug)
    if several:
        return _serve_on_processes(app, args)
    if key:
        log.info("API key required on every route but /health")
    from dspark_jax.engine.server_run import run_server

    log.info("serving on http://%s:%d (Ctrl-C / SIGTERM drains and exits)", args.host, args.port)
    run_server(app, args.host, args.port, drain_timeout_s=args.drain_timeout,
               log_level=args.log_level)  # fmt: skip
    log.info("stopped")
    return 0


def _serve_on_processes(app, args) -> int:
    """A mesh over several processes: process 0 serves HTTP and leads the engine's rounds, the
    others follow them (engine.multihost) until it stops."""
    import jax

    from dspark_jax.engine.multihost import Mirror
    from dspark_jax.engine.server_run import run_server

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
    from dspark_jax.models.hf import load_tokenizer
    from dspark_jax.train.tokenizer import special_token_ids

    if args.run_dir:
        from dspark_jax.run.rundir import RunDir

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
    from dspark_jax.drafters.compat import check_fits, vocab_hash
    from dspark_jax.drafters.hf import load_hf_drafter, load_hf_drafter_extras
    from dspark_jax.models.hf import load_target

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
    from dspark_jax.run.rundir import RunDir

    try:
        out = RunDir(args.run_dir).export_drafter(args.drafter, args.out)
    except user_errors() as e:
        return report(e, args.debug)
    print(f"exported the {args.drafter} drafter of {args.run_dir} to {out}")
    return 0


def _cost_profile(args, run_cost, run_where, n_params: int, policy: str):
    from dspark_jax.compat import load_cost_profile
    from dspark_jax.sched.cost import CostProfile

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
    import jax

    from dspark_jax.engine.serving import EngineConfig, ServingEngine
    from dspark_jax.engine.sharding import mesh_from_flag

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
        prefill_tokens_per_step=args.prefill_tokens_per_step,
        device_memory_gib=args.device_memory_gib,
    )  # fmt: skip
    log.info("%s", engine.memory_plan.summary())
    log.info("loaded %s (drafter %s, γ=%d, policy %s) in %.1f s",
             name, dcfg.kind, dcfg.block_size, policy, time.perf_counter() - t0)  # fmt: skip
    return engine, tok, stop_ids, args.model_name or name


def build_app(args):
    """`build_engine`, warm-up (every bucket compiled before the port opens), the app."""
    from dspark_jax.engine.server import create_app

    engine, tok, stop_ids, name = build_engine(args)
    t0 = time.perf_counter()
    engine.warmup()
    log.info("warm-up: %d compilations (%d read from the compilation cache) in %.1f s "
             "(slots %d, max_len %d tokens, token buckets %s)", engine.compilations,
             engine.compilations_from_cache, time.perf_counter() - t0, engine.num_slots,
             engine.token_limit, engine.token_buckets)  # fmt: skip
    return create_app(engine, tok, name, stop_ids=stop_ids, drain_timeout_s=args.drain_timeout,
                      api_key=api_key(args), max_body_bytes=args.max_body_bytes,
                      request_timeout_s=args.request_timeout or None)  # fmt: skip


def check_limits(args) -> None:
    """The access-limit and length flags, checked before any model loads."""
    if args.max_len < 0:
        raise ValueError(f"--max-len must be >= 0 (0: the target's context), got {args.max_len}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.request_timeout < 0:
        raise ValueError(f"--request-timeout must be >= 0 (0: no limit), got "
                         f"{args.request_timeout}")  # fmt: skip


def check_settings(args) -> None:
    """The policy flags against what the drafter records, before any model loads (the engine
    checks them again): γ within the trained block, the threshold a probability, the cost
    profile file measured for this device and recording what it was measured for."""
    from dspark_jax.compat import check_gamma, check_threshold, load_cost_profile

    check_threshold(args.threshold, "--threshold")
    if args.cost_profile:
        load_cost_profile(args.cost_profile)
    if args.gamma is None:
        return
    if args.run_dir:
        from dspark_jax.run.rundir import RunDir

        block = RunDir(args.run_dir).config.drafters.block_size
    else:
        from dspark_jax.models.hf import read_hf_config

        hf = read_hf_config(args.drafter)
        block = int(hf.get("block_size", hf.get("ttt_length", 7)))
    check_gamma(args.gamma, block, "--gamma")


def api_key(args) -> str:
    """`--api-key`, else $DSPARK_API_KEY (runtime.settings), else "" (no authentication)."""
    from dspark_jax import runtime

    return runtime.settings().api_key if args.api_key is None else args.api_key
