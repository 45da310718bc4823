"""The project's XLA:CPU fusion setting (`dspark_jax/xla_cpu.py`) against XLA's default.

XLA reads its flags once per process, so each setting runs in its own processes, alternated:
`target_step.py` (the demo target's loss + grad), `drafter_step.py` (the demo's three drafters'
micro-steps) and `decode_paths.py` (batch-32 decode, the 8-token verify forward at batch 1,
DSpark and Eagle3 proposals), each with DSPARK_XLA_CPU_DEFAULTS=off (XLA's default) and without
it (the project's setting). Only their ``current`` programs are read. Prints ONE JSON object:
``{program}_ms`` / ``default_{program}_ms`` (medians over the rounds), ``speedup`` {program:
default / set}, ``flag`` (what the project adds, null when this jaxlib is not one it was checked
on: then both columns are XLA's default), ``rounds``, ``platform``.

    python benchmarks/xla_cpu_flags.py [--rounds 1] [--reps 5]

Re-run it before adding a jaxlib release to `xla_cpu.CHECKED_JAXLIB`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from dspark_jax import xla_cpu  # noqa: E402

READ = {
    "target_step.py": {"target_step": "step_ms"},
    "drafter_step.py": {f"{k}_step": f"{k}_step_ms" for k in ("dspark", "dflash", "eagle3")},
    "decode_paths.py": {
        k: f"{k}_ms" for k in ("decode_b32", "verify_b1", "propose_dspark", "propose_eagle3")
    },
}


def _child(script: str, reps: int, default: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_cpu.ENV)}
    env["JAX_PLATFORMS"] = "cpu"
    if default:
        env[xla_cpu.ENV] = "off"
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, script), "--reps", str(reps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    flag = xla_cpu.apply_cpu_defaults({})
    times: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        for script, keys in READ.items():
            order = (True, False) if r % 2 == 0 else (False, True)
            for default in order:
                res = _child(script, args.reps, default)
                for name, key in keys.items():
                    times.setdefault((name, default), []).append(res[key])
                print(f"{script} {'default' if default else 'set'} done", file=sys.stderr)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    names = [n for keys in READ.values() for n in keys]
    res = {}
    for n in names:
        res[f"{n}_ms"] = round(med[(n, False)], 3)
        res[f"default_{n}_ms"] = round(med[(n, True)], 3)
    res["speedup"] = {n: round(med[(n, True)] / med[(n, False)], 3) for n in names}
    res["flag"] = flag
    res["rounds"] = args.rounds
    res["platform"] = f"{platform.machine()} x{os.cpu_count()}"
    print(json.dumps(res))


if __name__ == "__main__":
    main()
