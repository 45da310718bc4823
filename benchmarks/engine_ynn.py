"""The serving engine's XLA:CPU option (`xla_cpu.engine_compiler_options`: no YNNPACK fusion)
against XLA's default, and batch-1 plain decoding's prefill in its own program against the one
program it was before, on a demo run's models, in one process.

    python benchmarks/engine_ynn.py --run-dir runs/tiny [--prompts 4] [--passes 5]

Batch 1, the evaluate stage's speed protocol (`benchmarks/batch1.py`), by

    plain          `generate()` at batch 1 as shipped: prefill with the engine's option, the
                   decode loop with the batch-1 option (two programs)
    plain_one      the form before: prefill and loop in one program with the batch-1 option
    spec           DSpark on a 1-slot ServingEngine, 8 device-resident rounds per call, fixed γ
                   (the evaluate stage's speed decoder), compiled with the engine's option
    spec_default   the same engine compiled with XLA's default (the form before)

Then at 8 slots: the
evaluate stage's DSpark decoder (host-scheduled rounds) over the same prompts in batches of 8,
with the option and with XLA's default, alternated, `--passes` times.

Prints ONE JSON object: `<variant>_ms_per_token` (wall time over tokens emitted, all passes),
`speedup` = plain / spec ms per token (as shipped), `speedup_before` = plain_one / spec_default,
`speedup_pass_min` / `speedup_pass_max` (the passes' own ratios), `engine_option_gain` =
spec_default / spec, `prefill_split_gain` = plain_one / plain, `round_ms` / `round_default_ms`
(speculative wall time per round), `tokens_per_round`, `slots8_s` / `slots8_default_s` (medians)
and `slots8_gain`, `prompts`, `passes`, `platform`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if __name__ == "__main__":
    from dspark_jax.hugepages import rerun_with_hugepages

    rerun_with_hugepages()  # as train.py runs the evaluate stage (dspark_jax/hugepages.py)

import jax  # noqa: E402

from benchmarks.batch1 import Batch1, fail, ms_per_token, parser, round_ms, summary  # noqa: E402
from dspark_jax import xla_cpu  # noqa: E402
from dspark_jax.engine import programs  # noqa: E402
from dspark_jax.models import decoding  # noqa: E402
from dspark_jax.models import generate as gen  # noqa: E402

NAME = "engine_ynn"


def main() -> None:
    args = parser(__doc__).parse_args()
    Batch1.check(args, NAME)
    if xla_cpu.engine_compiler_options() is None:
        fail(NAME, "the engine's XLA:CPU option does not apply here (not CPU, an unchecked "
             f"jaxlib, {xla_cpu.ENV}=off or the option in XLA_FLAGS): nothing to compare")  # fmt: skip
    b = Batch1.load(args)
    from dspark_jax.run.evaluate_stage import eval_decoder

    p, prompts, e = b.pipeline, b.prompts, b.eval_cfg
    stop, temp, n_new = p.stop_ids(), e.temperature, e.max_new_tokens
    spec_eng = b.speed_decoder()
    with mock.patch.object(programs, "engine_compiler_options", lambda: None):
        spec_default_eng = b.speed_decoder()
    one = jax.jit(decoding._generate, static_argnames=("cfg", "scfg", "cache_len"),
                  compiler_options=xla_cpu.batch1_decode_compiler_options())  # fmt: skip
    plain = b.plain()

    def plain_one(q, seed):
        with (
            mock.patch.object(gen, "_batch1_programs", lambda: None),
            mock.patch.object(gen, "generate_jit", one),
        ):
            return plain(q, seed)

    variants = {"plain": plain, "plain_one": plain_one, "spec": b.spec(spec_eng),
                "spec_default": b.spec(spec_default_eng)}  # fmt: skip
    acc, _ = b.run(variants)
    ms = ms_per_token(acc)

    # 8 slots: the evaluate stage's decoder, host-scheduled rounds
    dec8 = eval_decoder(p, "dspark", b.longest)
    with mock.patch.object(programs, "engine_compiler_options", lambda: None):
        dec8_default = eval_decoder(p, "dspark", b.longest)
    nb = dec8.num_slots

    def batches(dec):
        t0 = time.perf_counter()
        for s in range(0, len(prompts), nb):
            dec.generate(prompts[s : s + nb], max_new_tokens=n_new, temperature=temp,
                         seeds=list(range(s, s + nb))[: len(prompts[s : s + nb])], stop_ids=stop)  # fmt: skip
        return time.perf_counter() - t0

    batches(dec8), batches(dec8_default)
    t8 = {"option": [], "default": []}
    for _ in range(args.passes):
        t8["option"].append(batches(dec8))
        t8["default"].append(batches(dec8_default))
    s8, s8d = statistics.median(t8["option"]), statistics.median(t8["default"])
    res = {
        **summary(acc),
        "speedup_before": round(ms["plain_one"] / ms["spec_default"], 4),
        "engine_option_gain": round(ms["spec_default"] / ms["spec"], 4),
        "prefill_split_gain": round(ms["plain_one"] / ms["plain"], 4),
        "round_default_ms": round(round_ms(acc, "spec_default"), 3),
        "slots": nb,
        "slots8_s": round(s8, 3),
        "slots8_default_s": round(s8d, 3),
        "slots8_gain": round(s8d / s8, 4),
        "prompts": len(prompts),
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
