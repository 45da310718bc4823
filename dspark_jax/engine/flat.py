"""Params flattened once for the engine's jitted calls.

A jitted call flattens its arguments on every call, and an `nnx.State` flattens in Python, one
call per `nnx.Variable`: for the demo's target and DSpark drafter (~210 variables) that was
~0.36 ms of host time per engine step on 2 CPU cores, against ~0.08 ms for the same arrays as a
list. `FlatParams` keeps the leaves and the tree structure, so a call flattens it in one Python
call; `flat_jit` rebuilds the tree inside the traced function (at trace time only).
"""

from __future__ import annotations

import functools

import jax


@jax.tree_util.register_pytree_node_class
class FlatParams:
    """A params tree (`nnx.State`, `DrafterParams`) as its leaves and tree structure."""

    __slots__ = ("leaves", "treedef")

    def __init__(self, leaves, treedef):
        self.leaves = list(leaves)
        self.treedef = treedef

    @classmethod
    def of(cls, tree) -> FlatParams:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(leaves, treedef)

    def tree(self):
        return jax.tree.unflatten(self.treedef, self.leaves)

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(leaves, treedef)


@functools.cache
def _unflattening(fn):
    """One wrapper per function, shared by every engine: JAX reuses a compiled program only for
    the same function object, so engines of the same shapes share their programs."""

    @functools.wraps(fn)
    def traced(*args):
        return fn(*(a.tree() if isinstance(a, FlatParams) else a for a in args))

    return traced


def flat_jit(fn, **jit_kw):
    """`jax.jit(fn, **jit_kw)` that accepts `FlatParams` for any argument and passes `fn` the
    rebuilt tree."""
    return jax.jit(_unflattening(fn), **jit_kw)
