"""The serving engine's target form on CPU: the tied LM head run from an untied [H, V] copy, and
the drafter reading the target's own tables, against the forms without, on a demo run's models,
in one process. (The fused q|k|v / gate|up form this also compared is gone from the engine: it
was 17% slower, benchmarks/results/engine_head.json's `unfused_gain`.)

    python benchmarks/engine_head.py --run-dir runs/tiny [--prompts 4] [--passes 5]

Batch 1, the evaluate stage's speed protocol (`benchmarks/batch1.py`, as engine_ynn.py), by

    plain         `generate()` at batch 1 as shipped (the tied head)
    plain_untied  the same with the untied copy (whether the baseline would gain from it too)
    spec          DSpark on a 1-slot ServingEngine, 8 device-resident rounds per call, fixed γ,
                  as shipped: untied head, separate products
    spec_tied     the same engine with the tied head (`serving.untie_applies` off)
    spec_unshared as shipped, but the drafter reads its own copies of the target's embedding and
                  LM head (`drafters.share_target_tables` off)

The three engines' tokens are compared on the warm-up pass.

Prints ONE JSON object: `<variant>_ms_per_token` (wall time over tokens emitted, all passes),
`speedup` = plain / spec, `speedup_pass_min` / `_max` (the passes' own ratios, as shipped),
`head_gain` = spec_tied / spec, `share_gain` = spec_unshared / spec, `plain_untied_ratio` =
plain_untied / plain ms per token, `round_ms` (wall time per round), `tokens_per_round`,
`same_tokens` (the three engines
emitted the same tokens on every warm-up prompt), `prompts`, `passes`, `platform`.
"""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if __name__ == "__main__":
    from dspark_jax.hugepages import rerun_with_hugepages

    rerun_with_hugepages()  # as train.py runs the evaluate stage (dspark_jax/hugepages.py)

import jax  # noqa: E402

from benchmarks.batch1 import Batch1, fail, ms_per_token, parser, summary  # noqa: E402
from dspark_jax.engine import serving  # noqa: E402
from dspark_jax.models import transformer as tf  # noqa: E402

NAME = "engine_head"


def main() -> None:
    args = parser(__doc__).parse_args()
    Batch1.check(args, NAME)
    if jax.default_backend() != "cpu":
        fail(NAME, "the untied head is a CPU form (serving.untie_applies): run this on CPU")
    b = Batch1.load(args)
    if not serving.untie_applies(b.tcfg, b.tparams):
        fail(NAME, "this run's target is not run untied by the engine (an untied head, or a "
             "table over serving.UNTIE_MAX_BYTES): nothing to compare")  # fmt: skip
    spec_eng = b.speed_decoder()
    with mock.patch.object(serving, "untie_applies", lambda *a: False):
        tied_eng = b.speed_decoder()
    with mock.patch.object(serving, "share_target_tables", lambda dparams, tparams: dparams):
        unshared_eng = b.speed_decoder()
    assert not spec_eng.tcfg.tie_word_embeddings and tied_eng.tcfg.tie_word_embeddings
    variants = {
        "plain": b.plain(),
        "plain_untied": b.plain(*tf.untie_lm_head(b.tcfg, b.tparams)),
        "spec": b.spec(spec_eng),
        "spec_tied": b.spec(tied_eng),
        "spec_unshared": b.spec(unshared_eng),
    }
    engines = ("spec", "spec_tied", "spec_unshared")
    acc, same = b.run(variants, compare=engines)
    ms = ms_per_token(acc)
    res = {
        **summary(acc),
        "head_gain": round(ms["spec_tied"] / ms["spec"], 4),
        "share_gain": round(ms["spec_unshared"] / ms["spec"], 4),
        "plain_untied_ratio": round(ms["plain_untied"] / ms["plain"], 4),
        "same_tokens": bool(same),
        "prompts": len(b.prompts),
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
