"""Settings that would quietly ruin acceptance, refused before any work.

One function per check; each raises one `ConfigError` naming the field and the fix. Called by
the run-directory loaders (`run.rundir`, `train.checkpoint`), the HF drafter loader, the
engine's constructor and scheduler, and the CLIs (`serve.py`, `train.py`) before they load
models. Whether a drafter fits a target (layer ids, shapes, vocabulary, dtype, context window)
is `drafters.compat.check_fits`; this module holds the rest:

    check_gamma            γ / a policy's maximum length above the drafter's trained block
    check_trained_block    a drafter config whose block differs from its checkpoint's
    check_sts              STS temperatures fitted for another γ
    check_cost_profile     a cost profile measured for another target or device
    load_cost_profile      a profile file must record what it was measured for
    check_drafter_dtype    drafter parameters in a dtype other than their config's
    check_sampling         sampling knobs of a config (pipeline stages, CLI flags) out of range
    check_threshold        a confidence threshold outside [0, 1]
"""

from __future__ import annotations

import logging
import os
from pathlib import Path, PurePath

import numpy as np

from dspark_jax import data as packaged_data
from dspark_jax.errors import ConfigError
from dspark_jax.sampling_knobs import check_sampling_knobs
from dspark_jax.sched.cost import CostProfile
from dspark_jax.sched.sts import STS

log = logging.getLogger(__name__)

__all__ = [
    "check_cost_profile",
    "check_drafter_dtype",
    "check_gamma",
    "check_sampling",
    "check_threshold",
    "check_sts",
    "check_trained_block",
    "device_name",
    "load_cost_profile",
    "target_shape_key",
]


def check_gamma(value: int, block_size: int, field: str = "gamma") -> None:
    """`value` (γ, a fixed policy's length, a policy's maximum length) within the drafter's
    trained block: drafts past it were never trained and verify undrafted positions."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{field} must be an integer >= 0, got {value!r}")
    if value > block_size:
        raise ConfigError(
            f"{field}={value} exceeds the drafter's trained block size {block_size} — use "
            f"{field} <= {block_size} (or a drafter trained with block_size >= {value})"
        )


def check_trained_block(block_size: int, trained_block: int | None, where: str = "") -> None:
    """A drafter config's block size equals the block its checkpoint was trained with (None:
    not recorded). Its parameters load either way, so a mismatch would pass silently."""
    if trained_block is not None and int(trained_block) != int(block_size):
        at = f" ({where})" if where else ""
        raise ConfigError(
            f"drafters.block_size={block_size} but the drafter was trained with block_size="
            f"{trained_block}{at} — set drafters.block_size={trained_block} (or retrain)"
        )


def check_trained_window(window: int, trained_window: int | None, where: str = "") -> None:
    """A drafter config's context window equals the one its checkpoint was trained with (None:
    not recorded, i.e. 0, the whole context); serving narrows it afterwards
    (`drafters.api.narrow_context_window`)."""
    trained = int(trained_window or 0)
    if trained != int(window):
        at = f" ({where})" if where else ""
        raise ConfigError(
            f"drafters.context_window={window} but the drafter was trained with context_window="
            f"{trained}{at} — set drafters.context_window={trained} (or retrain)"
        )


def check_sts(sts: STS | None, gamma: int) -> None:
    """STS temperatures are per draft position, fitted for one γ: another γ's are refused."""
    if sts is not None and len(sts.temperatures) != gamma:
        raise ConfigError(
            f"STS calibration has {len(sts.temperatures)} confidence_temperatures but the drafter "
            f"drafts γ={gamma} — recalibrate for γ={gamma} (train.py --force calibrate)"
        )


def device_name() -> str:
    """The device a cost profile is measured on: platform, kind and count (e.g. `cpu:cpu x1`,
    `gpu:NVIDIA H200 x1`)."""
    import jax  # here: the config check imports this module before jax loads

    devs = jax.devices()
    return f"{devs[0].platform}:{devs[0].device_kind} x{len(devs)}"


def target_shape_key(tcfg) -> str:
    """What a round's cost depends on in the target: its architecture and shapes."""
    return (
        f"{tcfg.architecture} L{tcfg.num_layers} H{tcfg.hidden_size} I{tcfg.intermediate_size} "
        f"heads{tcfg.num_heads}/{tcfg.num_kv_heads}x{tcfg.head_dim} V{tcfg.vocab_size} "
        f"{tcfg.dtype}"
    )


def check_cost_profile(
    cost: CostProfile | None, tcfg=None, *, require_record: bool = False, where: str = ""
) -> None:
    """A cost profile charges a round what it costs this target on this device: one measured
    for another target (`cost.target`) or device (`cost.device`) is refused. A profile that
    records neither is accepted when built in code or when it is a packaged default; one read
    from a file (`require_record=True`) that records neither (an older version's) is used with a
    warning: refusing it would strand the profiles of existing runs. `tcfg=None`: the target is not
    compared (a loader that has not loaded it yet; the engine compares it)."""
    if cost is None:
        return
    at = f" {where}" if where else ""
    fix = "measure one here with benchmarks/decode_cost.py --run-dir <run> (or --out FILE)"
    if require_record and not (cost.target and cost.device):  # written before they were recorded
        log.warning("cost profile%s does not record the target and device it was measured for "
                    "(written by an older version); it is used as it is — %s", at, fix)  # fmt: skip
        return
    if tcfg is not None and cost.target and cost.target != target_shape_key(tcfg):
        raise ConfigError(
            f"cost profile{at} was measured for target '{cost.target}', this target is "
            f"'{target_shape_key(tcfg)}' — {fix}"
        )
    if cost.device and cost.device != device_name():
        raise ConfigError(
            f"cost profile{at} was measured on '{cost.device}', this process runs on "
            f"'{device_name()}' — {fix}"
        )


def load_cost_profile(path: str | os.PathLike) -> CostProfile:
    """`CostProfile.load(path)`, refused when it records another device (the engine compares
    the target once it is loaded); a file that records neither is used with a warning unless it
    is one of the profiles packaged in dspark_jax/data (the server's fallback, which says in its
    log that it was measured on another machine)."""
    remote = isinstance(path, PurePath) and not isinstance(path, Path)  # a bucket URL's path
    here = Path(packaged_data.__file__).resolve().parent
    packaged = not remote and Path(path).resolve().parent == here
    cost = CostProfile.load(path)
    check_cost_profile(cost, require_record=not packaged, where=str(path))
    return cost


def check_drafter_dtype(dcfg, dparams) -> None:
    """Every floating parameter of the drafter in its config's dtype: heads loaded in another
    dtype (float16 confidence logits overflow; a cast copy is not what was trained) are refused."""
    import jax  # here: the config check imports this module before jax loads

    want = np.dtype(jax.numpy.bfloat16 if dcfg.dtype == "bfloat16" else np.float32)
    bad = sorted(
        {
            str(x.dtype)
            for x in jax.tree.leaves(getattr(dparams, "trainable", dparams))
            if hasattr(x, "dtype")
            and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
            and np.dtype(x.dtype) != want
        }
    )
    if bad:
        raise ConfigError(
            f"drafter parameters are {'/'.join(bad)} but its config says dtype={dcfg.dtype!r} — "
            f"load the drafter with dtype={dcfg.dtype!r} (or cast every parameter to it)"
        )


def check_sampling(field: str, temperature, top_k=0, top_p=1.0) -> None:
    """Sampling knobs of a configuration (`spec.sampling.validate_sampling_params`' ranges,
    the ones every request is held to), named by their config field."""
    try:
        check_sampling_knobs(temperature, top_k, top_p)
    except ValueError as e:
        raise ConfigError(f"{field}: {e} — fix {field} in the config (or with --set)") from None


def check_threshold(theta: float, field: str = "threshold") -> None:
    """A confidence threshold is a probability: outside [0, 1] it admits all or nothing."""
    if not (np.isfinite(theta) and 0.0 <= theta <= 1.0):
        raise ConfigError(f"{field}={theta!r} must be in [0, 1] — use e.g. 0.5")
