"""Multi-process launch flags and `jax.distributed` initialisation (one command per host).

Importing this module does not import jax: `train.py` registers these flags and checks its
preset, overrides and stage names before jax loads, so such a mistake is reported in a fraction
of a second (`serve.py` registers them too, but imports jax first); `init_distributed` then
imports jax and must run before anything touches devices.
"""

from __future__ import annotations

from dspark_jax import runtime
from dspark_jax.errors import ConfigError

DISTRIBUTED_HELP = """\
multi-process (one command per host, same flags except --process-id):
  --coordinator HOST:PORT --num-processes N --process-id I   (or the environment:
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); --distributed alone lets JAX
  detect the cluster (TPU pod slices, SLURM, Open MPI, Kubernetes)."""


def add_distributed_flags(ap) -> None:
    """`--coordinator`, `--num-processes`, `--process-id`, `--distributed` on an argparse parser."""
    g = ap.add_argument_group("multi-process launch", DISTRIBUTED_HELP)
    g.add_argument("--coordinator", default="", metavar="HOST:PORT", help="process 0's address")
    g.add_argument("--num-processes", type=int, default=0, help="processes in the run (hosts)")
    g.add_argument("--process-id", type=int, default=-1, help="this process, 0 .. N-1")
    g.add_argument(
        "--distributed", action="store_true", help="jax.distributed.initialize() auto-detection"
    )


def init_distributed(
    coordinator: str = "", num_processes: int = 0, process_id: int = -1, auto: bool = False
) -> bool:
    """`jax.distributed.initialize` from flags, else the environment; must run before anything
    touches devices. Returns True when this is a multi-process run.

    Flags win over JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; with none of
    them and `auto` False this is a single-process run (nothing is initialised). With `auto`,
    JAX detects the cluster (TPU pod slice, SLURM, Open MPI, Kubernetes) for what is not given.
    """
    env = runtime.settings()
    coordinator = coordinator or env.coordinator
    if not num_processes and env.num_processes:
        num_processes = int(env.num_processes)
    if process_id < 0 and env.process_id:
        process_id = int(env.process_id)
    if not (coordinator or auto):
        if num_processes > 1 or process_id >= 0:
            raise ConfigError(
                "--num-processes/--process-id need --coordinator HOST:PORT (process 0's address)"
                " — or pass --distributed to let JAX detect the cluster"
            )
        return False
    if coordinator and not auto and (num_processes < 1 or process_id < 0):
        raise ConfigError(
            f"--coordinator {coordinator} needs --num-processes N and --process-id I (0 .. N-1)"
        )
    if num_processes and process_id >= num_processes:
        raise ConfigError(f"--process-id {process_id} must be in 0 .. {num_processes - 1}")
    import jax  # here, not at import: train.py checks its configuration before jax loads

    try:
        jax.distributed.initialize(
            coordinator_address=coordinator or None,
            num_processes=num_processes or None,
            process_id=process_id if process_id >= 0 else None,
        )
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"jax.distributed.initialize failed ({first}) — check --coordinator, "
            "--num-processes and --process-id (the same coordinator on every host)"
        ) from None
    return jax.process_count() > 1
