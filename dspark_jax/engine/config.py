"""The serving engine's configuration (`EngineConfig`, frozen) and its sampling modes.

    cfg = EngineConfig.build(tcfg, dcfg, num_slots=8, max_len=1024, rounds_per_call=4)

`build` checks the values against the target and drafter and resolves the buckets: token buckets
(packed verify tokens, capped at num_slots * (γ + 1)), cache buckets (attention reads, capped at
max_len) and prompt buckets (prefill chunks). Every other engine object takes the config it needs
from here; nothing in it changes after construction.

Sampling modes, cheapest first: argmax; temperature only; top-k / top-p / min-p filters (a sort
over the vocabulary per row). A round runs in the cheapest mode that honours all its requests; a
request's tokens are the same in every mode that honours it (`mode_for`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_jax.buckets import ENGINE_PROMPT_BUCKETS
from dspark_jax.errors import ConfigError
from dspark_jax.spec.sampling import SamplingConfig, SamplingParams

MODES = ("greedy", "sampled", "filtered")
KV_LAYOUTS = ("slots", "paged")
SAMPLING = {
    "greedy": SamplingConfig(greedy=True),
    "sampled": SamplingConfig(),
    "filtered": SamplingConfig(top_k=True, top_p=True, min_p=True),
}


def _buckets(values, top: int) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in values if 0 < int(v) < top} | {int(top)}))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Slots, lengths, buckets, modes and loop knobs of one engine (resolved by `build`)."""

    num_slots: int = 8
    max_len: int = 1024
    gamma: int = 1  # the drafter's block size
    token_buckets: tuple[int, ...] = ()
    cache_buckets: tuple[int, ...] = ()
    prompt_buckets: tuple[int, ...] = ENGINE_PROMPT_BUCKETS
    modes: tuple[str, ...] = MODES
    rounds_per_call: int = 1
    max_queue: int = 256
    root_seed: int = 0
    # "paged" (the default): K/V in page pools (engine.paged_engine, docs/PAGED_KV.md);
    # "slots": every row reserves max_len positions
    kv_layout: str = "paged"
    page_size: int = 16
    # the pool's pages (0: sized by the engine, `paged_engine.plan_pool`: from kv_memory_gib,
    # else from what the devices report, else num_slots * max_len positions)
    num_pages: int = 0
    kv_memory_gib: float = 0.0  # the K/V pools' memory per device (0: see num_pages)
    # prompt tokens prefilled per step (0: no bound); whole chunks of prompt_buckets[-1], at
    # least one per step, so a long prompt is prefilled over several steps between rounds
    prefill_tokens_per_step: int = 0
    # the devices' memory for the engine's plan (`engine.memory`); 0: what they report
    device_memory_gib: float = 0.0

    @classmethod
    def build(
        cls,
        tcfg,
        dcfg,
        *,
        num_slots: int = 8,
        max_len: int = 1024,
        prompt_buckets=ENGINE_PROMPT_BUCKETS,
        token_buckets=None,
        cache_buckets=None,
        modes=MODES,
        rounds_per_call: int = 1,
        max_queue: int = 256,
        root_seed: int = 0,
        kv_layout: str = "paged",
        page_size: int = 16,
        num_pages: int = 0,
        kv_memory_gib: float = 0.0,
        prefill_tokens_per_step: int = 0,
        device_memory_gib: float = 0.0,
    ) -> EngineConfig:
        """Checked against the target (ConfigError) and with every bucket tuple resolved."""
        if num_slots < 1 or max_len < 2:
            raise ConfigError(f"num_slots ({num_slots}) must be >= 1 and max_len >= 2")
        g = dcfg.block_size
        if max_len > tcfg.max_position_embeddings + g + 1:
            # a request's tokens stay within the context; its last round's γ + 1 verified
            # positions may lie past it (their K/V are never read by a committed token)
            raise ConfigError(
                f"max_len {max_len} exceeds the target's context (max_position_embeddings "
                f"{tcfg.max_position_embeddings}) plus γ + 1 = {g + 1} lookahead positions; use "
                f"max_len <= {tcfg.max_position_embeddings + g + 1}"
            )
        if not (isinstance(rounds_per_call, int) and rounds_per_call >= 1):
            raise ConfigError(f"rounds_per_call must be an integer >= 1, got {rounds_per_call!r}")
        if not set(modes) <= set(MODES) or not modes:
            raise ConfigError(f"modes must be a non-empty subset of {MODES}: {modes}")
        if kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        if not device_memory_gib >= 0:
            raise ConfigError(
                f"device_memory_gib must be >= 0 (0: as reported), got {device_memory_gib!r}"
            )
        if page_size < 1 or num_pages < 0:
            raise ConfigError(f"page_size ({page_size}) must be >= 1 and num_pages >= 0")
        if not kv_memory_gib >= 0:
            raise ConfigError(
                f"kv_memory_gib must be >= 0 (0: sized otherwise), got {kv_memory_gib!r}"
            )
        if num_pages and kv_memory_gib:
            raise ConfigError(
                f"num_pages ({num_pages}) and kv_memory_gib ({kv_memory_gib}) both size the page "
                "pool: give one (--num-pages or --kv-memory-gb)"
            )
        if kv_layout == "slots":  # the rows' dense caches; no pool
            num_pages = num_pages or -(-num_slots * max_len // page_size)
        if not (isinstance(prefill_tokens_per_step, int) and prefill_tokens_per_step >= 0):
            raise ConfigError(
                f"prefill_tokens_per_step must be an integer >= 0 (0: no bound), got "
                f"{prefill_tokens_per_step!r}"
            )
        top = num_slots * (g + 1)
        if token_buckets is None:
            token_buckets = [1 << i for i in range(top.bit_length())]
        return cls(
            num_slots=num_slots,
            max_len=max_len,
            gamma=g,
            token_buckets=_buckets(token_buckets, top),
            cache_buckets=_buckets(cache_buckets or (), max_len),
            prompt_buckets=_buckets(prompt_buckets, min(max(prompt_buckets), max_len)),
            modes=tuple(modes),
            rounds_per_call=rounds_per_call,
            max_queue=max_queue,
            root_seed=root_seed,
            kv_layout=kv_layout,
            page_size=page_size,
            num_pages=num_pages,
            kv_memory_gib=float(kv_memory_gib),
            prefill_tokens_per_step=prefill_tokens_per_step,
            device_memory_gib=float(device_memory_gib),
        )

    def for_models(self, tcfg, dcfg) -> EngineConfig:
        """This config checked and resolved by `build` for these models (γ from the drafter);
        a config `build` made for them comes back equal."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "gamma"}
        return EngineConfig.build(tcfg, dcfg, **kw)

    @property
    def token_limit(self) -> int:
        """Prompt + new tokens one request may hold: max_len less the γ + 1 positions a
        verification round writes past its last committed token."""
        return self.max_len - self.gamma - 1

    @staticmethod
    def max_len_for(tokens: int, gamma: int) -> int:
        """The max_len whose `token_limit` is `tokens` (e.g. the target's context)."""
        return tokens + gamma + 1

    @property
    def single_program(self) -> bool:
        """One (token, cache) bucket pair: one verify program per mode."""
        return len(self.token_buckets) * len(self.cache_buckets) == 1

    def prefill_cache_len(self, end: int) -> int:
        """The cache bucket a prefill chunk ending (padded) at `end` attends over."""
        return next((b for b in self.cache_buckets if b >= end), self.max_len)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (chunk bucket, cache bucket) a prefill can use: a chunk of bucket c starting at
        0 reads the bucket >= c; later chunks (long prompts) start further in."""
        lo = {c: self.prefill_cache_len(c) for c in self.prompt_buckets}
        return [(c, s) for c in self.prompt_buckets for s in self.cache_buckets if s >= lo[c]]

    def mode_for(self, params) -> str:
        """The cheapest compiled sampling mode that honours every request in `params`
        (RuntimeError when none of this engine's modes does)."""
        need = 0
        for p in params:
            if p.temperature > 0:
                filt = p.top_k > 0 or p.top_p < 1 or p.min_p > 0
                need = max(need, 2 if filt else 1)
        for mode in MODES[need:]:
            if mode in self.modes:
                return mode
        raise RuntimeError(f"a request needs sampling mode {MODES[need]!r}; modes={self.modes}")


def sampling_rows(params, mode: str) -> SamplingParams | None:
    """Per-row sampling knobs of `params` (one RequestParams per row); None in greedy mode."""
    if mode == "greedy":
        return None
    return SamplingParams(
        np.asarray([p.temperature for p in params], np.float32),
        np.asarray([p.top_k for p in params], np.int32),
        np.asarray([p.top_p for p in params], np.float32),
        np.asarray([p.min_p for p in params], np.float32),
    )
