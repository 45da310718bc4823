"""The serving engine's device half, one object: `EnginePrograms` holds the params (flattened
once, `engine.flat`), the slot state, the root key and the jitted programs, and runs them.

    progs = EnginePrograms(tcfg, dcfg, tparams, dparams, config, mesh=None)
    state, out = progs.round(state, RoundInputs(lengths, active, seeds, sampling, progs.key),
                             mode="greedy", num_tokens=8, cache_len=256)   # pure: state donated
    out = progs.step_round(inputs, mode=..., num_tokens=..., cache_len=...)  # on progs.state

Each program takes a static spec (configs, sampling mode, buckets: `device.PrefillSpec`,
`device.RoundSpec`, `rounds.RoundsSpec`) and its arrays as one NamedTuple (`PrefillInputs`,
`RoundInputs`, `RoundsInputs`). The pure calls (`prefill`, `round`, `rounds`) take and return a
state; the `step_*` calls run on the held state (`self.state`). `snapshot()` copies the state (a
timer restarts a donated chain from it); `set_timer(fn)` blocks every call on its outputs and
reports `fn(program, ms, outputs)`, which is how eval/speed.py and benchmarks time them.
`set_fault(fn)` runs every call as `fn(program, run)` (tests inject device errors through it:
raise before `run()`, or after it, when the donated state is gone); `reset_state()` replaces a
state a failed call consumed with a fresh one.

The state and the key are created by a jitted function with their shardings (`out_shardings`),
on the mesh by the logical-axis table (`engine.sharding`) or on the default device, so no array
is staged on device 0 first. On a mesh the programs' outputs are pinned to those shardings, so a
round never changes its arguments' layout and never recompiles after warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import parallel
from dspark_jax.engine import device as dev
from dspark_jax.engine import rounds as rounds_lib
from dspark_jax.engine.config import SAMPLING, EngineConfig, sampling_rows
from dspark_jax.engine.device import PrefillInputs, PrefillSpec, RoundInputs, RoundSpec
from dspark_jax.engine.flat import FlatParams, flat_jit
from dspark_jax.engine.memory import check_engine_memory, plan_engine_memory
from dspark_jax.engine.requests import RequestParams
from dspark_jax.engine.rounds import RoundsInputs, RoundsSpec
from dspark_jax.engine.sharding import place_params, state_shardings
from dspark_jax.runtime.xla_cpu import engine_compiler_options

Timer = Callable[[str, float, object], None]
Fault = Callable[[str, Callable[[], tuple]], tuple]


def _default_device():
    dflt = jax.config.jax_default_device
    return dflt if isinstance(dflt, jax.Device) else jax.local_devices()[0]


def _created(fn, sharding):
    """`fn()`'s arrays created by a jitted call directly with `sharding` (a tree or one)."""
    return jax.jit(fn, out_shardings=sharding)()


def _jitted(state_sharding, replicated, fns=None):
    """(prefill, round, rounds) jitted with the engine's XLA:CPU option (read for each, in that
    order); on a mesh their outputs pinned to the state's shardings (the rest replicated).
    `fns`: the three functions (default: the slot layout's)."""
    prefill, round_, rounds = fns or (dev.prefill_chunk, dev.packed_round,
                                      rounds_lib.packed_rounds)  # fmt: skip

    def kw(n_replicated):
        opts = engine_compiler_options()
        if state_sharding is None:
            return {"compiler_options": opts}
        outs = (state_sharding,) + (replicated,) * n_replicated
        return {"compiler_options": opts, "out_shardings": outs}

    common = dict(static_argnums=(0,), donate_argnums=(3,))
    return (
        flat_jit(prefill, **common, **kw(2)),
        flat_jit(round_, **common, **kw(1)),
        flat_jit(rounds, **common, **kw(1)),
    )


class EnginePrograms:
    """Params, slot state, root key and the jitted prefill / round / K-round programs."""

    def __init__(self, tcfg, dcfg, tparams, dparams, config: EngineConfig, mesh=None):
        self.tcfg, self.dcfg, self.config, self.mesh = tcfg, dcfg, config, mesh
        self._init = init = self._state_init()
        abstract = jax.eval_shape(init)
        if mesh is None:
            state_sh = repl = jax.sharding.SingleDeviceSharding(_default_device())
        else:
            state_sh = self._state_shardings(abstract, mesh)
            repl = parallel.replicated(mesh)
        # planned (and refused when it cannot fit) before anything is placed or created
        self.memory_plan = plan_engine_memory(tcfg, config, tparams, dparams, abstract, state_sh,
                                              mesh)  # fmt: skip
        check_engine_memory(self.memory_plan, config)
        if mesh is not None:
            tparams, dparams = place_params(tparams, mesh), place_params(dparams, mesh)
        self.tparams, self.dparams = tparams, dparams
        self._state_sh = state_sh
        self.state: dev.SlotState = _created(init, state_sh)
        self.key = _created(lambda: jax.random.key(config.root_seed), repl)
        # (target, drafter) params as the programs take them: flattened once, not per call
        self.params = (FlatParams.of(tparams), FlatParams.of(dparams))
        # The verify forward's form (`device.verify_forward`), the same in the one-round and the
        # K-round programs, whatever rounds_per_call: with one (T, S) program on unsplit weights
        # (no tensor parallelism) the tokens' K/V are read back from the cache in one key set.
        tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
        self.one_set = config.single_program and tensor == 1
        if mesh is None:  # one device: the programs as every such engine compiles them
            state_sh = repl = None
        self._prefill, self._round, self._rounds = self._jit_programs(state_sh, repl)
        self._timer: Timer | None = None
        self._fault: Fault | None = None

    def _state_init(self):
        """The function that creates the state (a subclass's layout overrides it)."""
        tcfg, dcfg, c = self.tcfg, self.dcfg, self.config
        return lambda: dev.init_state(tcfg, dcfg, c.num_slots, c.max_len)

    def _state_shardings(self, abstract_state, mesh):
        """The state's NamedShardings on `mesh` (a subclass's layout overrides it)."""
        return state_shardings(abstract_state, mesh)

    def _jit_programs(self, state_sh, repl):
        """(prefill, round, rounds), jitted (a subclass's layout overrides it)."""
        return _jitted(state_sh, repl)

    # ---- specs and inputs --------------------------------------------------------------------

    def prefill_spec(self, mode: str, cache_len: int) -> PrefillSpec:
        return PrefillSpec(self.tcfg, self.dcfg, SAMPLING[mode], cache_len)

    def round_spec(self, mode: str, num_tokens: int, cache_len: int) -> RoundSpec:
        return RoundSpec(self.tcfg, self.dcfg, SAMPLING[mode], num_tokens, cache_len, self.one_set)

    def rounds_spec(self, mode: str) -> RoundsSpec:
        c = self.config
        return RoundsSpec(self.tcfg, self.dcfg, SAMPLING[mode], c.token_buckets, c.cache_buckets,
                          c.rounds_per_call, self.one_set)  # fmt: skip

    # ---- pure calls (state donated, returned) ------------------------------------------------

    def prefill(self, state, inputs: PrefillInputs, *, mode: str, cache_len: int):
        """(state, first token, raw confidence logits [γ]) after one prompt chunk."""
        spec = self.prefill_spec(mode, cache_len)
        return self._call("prefill", self._prefill, spec, state, inputs)

    def round(self, state, inputs: RoundInputs, *, mode: str, num_tokens: int, cache_len: int):
        """(state, device.RoundOut) after one packed round."""
        spec = self.round_spec(mode, num_tokens, cache_len)
        return self._call("round", self._round, spec, state, inputs)

    def rounds(self, state, inputs: RoundsInputs, *, mode: str):
        """(state, rounds.RoundsOut) after up to K device-resident rounds."""
        return self._call("rounds", self._rounds, self.rounds_spec(mode), state, inputs)

    def _call(self, name, fn, spec, state, inputs):
        if self._fault is not None:
            return self._fault(name, lambda: self._timed(name, fn, spec, state, inputs))
        return self._timed(name, fn, spec, state, inputs)

    def _timed(self, name, fn, spec, state, inputs):
        if self._timer is None:
            return fn(spec, *self.params, state, inputs)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(spec, *self.params, state, inputs))
        self._timer(name, (time.perf_counter() - t0) * 1e3, out[1:] if len(out) > 2 else out[1])
        return out

    # ---- on the held state -------------------------------------------------------------------

    def step_prefill(self, inputs: PrefillInputs, **spec):
        self.state, first, conf = self.prefill(self.state, inputs, **spec)
        return first, conf

    def step_round(self, inputs: RoundInputs, **spec):
        self.state, out = self.round(self.state, inputs, **spec)
        return out

    def step_rounds(self, inputs: RoundsInputs, **spec):
        self.state, out = self.rounds(self.state, inputs, **spec)
        return out

    # ---- profiling and inspection ------------------------------------------------------------

    def set_timer(self, timer: Timer | None) -> None:
        """`timer(program, ms, outputs)` after every call ("prefill", "round", "rounds"), each
        blocked on its outputs; None: calls are asynchronous again."""
        self._timer = timer

    def set_fault(self, fault: Fault | None) -> None:
        """Run every call as `fault(program, run)` ("prefill", "round", "rounds"; `run()` makes
        the call and returns its outputs): a test's way to inject a device error. None: off."""
        self._fault = fault

    def reset_state(self) -> None:
        """A fresh state (every slot empty) in place of one a failed call consumed."""
        self.state = _created(self._init, self._state_sh)

    def snapshot(self, state=None) -> dev.SlotState:
        """A copy of `state` (default: the held state) that no call donates."""
        return jax.tree.map(jnp.copy, self.state if state is None else state)

    def lower_round(self, state, inputs: RoundInputs, *, mode, num_tokens, cache_len):
        """The round program lowered for these arguments (`.compile().as_text()`: its HLO)."""
        spec = self.round_spec(mode, num_tokens, cache_len)
        return self._round.lower(spec, *self.params, state, inputs)

    def lower_rounds(self, state, inputs: RoundsInputs, *, mode):
        return self._rounds.lower(self.rounds_spec(mode), *self.params, state, inputs)

    # ---- inputs for calls with nothing active (warm-up) ----------------------------------------

    def idle_round_inputs(self, mode: str) -> RoundInputs:
        n = self.config.num_slots
        sp = sampling_rows([RequestParams(1)] * n, mode)
        z = np.zeros(n, np.int32)
        return RoundInputs(z, np.zeros(n, bool), np.zeros(n, np.uint32), sp, self.key)

    def idle_rounds_inputs(self, mode: str) -> RoundsInputs:
        n, g = self.config.num_slots, self.config.gamma
        sp = sampling_rows([RequestParams(1)] * n, mode)
        stop = np.full((n, rounds_lib.MAX_STOP_IDS), -1, np.int32)
        return RoundsInputs(np.zeros(n, bool), np.zeros(n, np.uint32), sp, self.key,
                            np.zeros(n, np.int32), stop, np.int32(g), np.bool_(False),
                            np.zeros(g, np.float32), np.int32(0))  # fmt: skip

    def warmup(self) -> None:
        """Compile every (mode, chunk, cache) prefill, (mode, T, S) round and, with K > 1, every
        mode's K-round call, run on free slots with nothing active: they leave no trace."""
        c = self.config
        for mode in c.modes:
            sp1 = sampling_rows([RequestParams(1)], mode)
            for chunk, s in c.prefill_shapes():
                z = np.zeros(chunk, np.int32)
                inp = PrefillInputs(np.int32(0), z, z, np.int32(0), np.int32(1), np.bool_(True),
                                    np.uint32(0), sp1, self.key)  # fmt: skip
                self.step_prefill(inp, mode=mode, cache_len=s)
            for t in c.token_buckets:
                for s in c.cache_buckets:
                    self.step_round(self.idle_round_inputs(mode), mode=mode, num_tokens=t,
                                    cache_len=s)  # fmt: skip
            if c.rounds_per_call > 1:  # nothing active: compiles, runs no round
                self.step_rounds(self.idle_rounds_inputs(mode), mode=mode)
        jax.block_until_ready(self.state)
