"""Params cast once to the dtype the model reads them in, for a loop that would convert them every pass.

The params are float32; a bfloat16 model converts each matrix to bfloat16 where it multiplies
with it. In a decode loop that conversion runs every token and reads and writes more memory than
the multiplication itself. `cast_as_read` converts, before the loop, each leaf that the model
only ever reads through a conversion to one dtype, which leaves every value the model computes
unchanged (bit for bit: the conversion it skips would have given the same array):

    read = cast_as_read(params, lambda p: forward_cached(p, cfg, tokens, cache, kernels=kernels))

Which leaves qualify is read from the traced program of `fn` (its jaxpr), not from a list of
names, so every kernel set and every block variant answers for itself. A leaf read both ways (a
tied embedding: its rows looked up in float32, the whole table converted for the head) keeps
its dtype; `forward_cached(tied_head=...)` gives such a head its own converted copy.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.extend import core

Params = Any


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, list[Any]]]:
    """(sub-jaxpr, the eqn's operands its inputs take) for the higher-order primitives whose
    operands map to their body's inputs one to one (jit, remat, custom derivatives, scan,
    shard_map) and for cond's branches; an unknown higher-order primitive gives []."""
    if eqn.primitive.name == "cond":
        return [(branch.jaxpr, list(eqn.invars[1:])) for branch in eqn.params["branches"]]
    found = []
    for value in eqn.params.values():
        jaxpr = getattr(value, "jaxpr", value)
        if isinstance(jaxpr, core.Jaxpr) and len(jaxpr.invars) == len(eqn.invars):
            found.append((jaxpr, list(eqn.invars)))
    return found


def _read_as(jaxpr: Any, var: Any) -> set[Any]:
    """The dtypes `var` is read in within `jaxpr`: the target of each conversion that reads it,
    followed into the bodies it is passed to; None in the set for any other read."""
    reads: set[Any] = set()
    if var in jaxpr.outvars:
        reads.add(None)
    for eqn in jaxpr.eqns:
        positions = [i for i, operand in enumerate(eqn.invars) if operand is var]
        if not positions:
            continue
        if eqn.primitive.name == "convert_element_type":
            reads.add(np.dtype(eqn.params["new_dtype"]))
            continue
        subs = _sub_jaxprs(eqn)
        if not subs:
            reads.add(None)  # an ordinary op reads it as it is, or a body this module cannot follow
            continue
        for body, operands in subs:
            for at, operand in enumerate(operands):
                if operand is var:
                    reads |= _read_as(body, body.invars[at])
    return reads


def read_dtypes(fn: Callable[[Params], Any], params: Params) -> list[Any]:
    """Per leaf of `params` (in `jax.tree_util.tree_leaves` order): the one dtype other than its
    own that `fn` only ever reads it in, else None. `params` may be arrays or `jax.ShapeDtypeStruct`s."""
    closed = jax.make_jaxpr(fn)(params)
    answers = []
    for leaf, var in zip(jax.tree_util.tree_leaves(params), closed.jaxpr.invars):
        reads = _read_as(closed.jaxpr, var)
        only = next(iter(reads)) if len(reads) == 1 else None
        answers.append(only if only is not None and only != np.dtype(leaf.dtype) else None)
    return answers


def cast_leaf(leaf: Any, dtype: Any) -> Any:
    """`leaf` converted to `dtype` (None: as it is); a `jax.ShapeDtypeStruct` keeps its sharding."""
    if dtype is None:
        return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
    return leaf.astype(dtype)


def read_targets(params: Params, fn: Callable[[Params], Any]) -> list[Any]:
    """Per leaf of `params`: the dtype to convert it to before `fn` runs (module docstring), else
    None. A leaf that `fn` would convert back after the cast (a layer that promotes its weights to
    float32 before a kernel converts them to bfloat16) is kept: casting it would trade one
    conversion for another."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    targets = read_dtypes(fn, params)
    again = read_dtypes(fn, tree.unflatten([cast_leaf(x, t) for x, t in zip(leaves, targets)]))
    return [t if more is None else None for t, more in zip(targets, again)]


def cast_as_read(params: Params, fn: Callable[[Params], Any]) -> Params:
    """`params` with each leaf that `fn` reads only through one conversion already converted."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    return tree.unflatten([cast_leaf(x, t) for x, t in zip(leaves, read_targets(params, fn))])
