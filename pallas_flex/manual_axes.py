"""Varying manual mesh axes: the types of values inside a `jax.shard_map` that checks them
(check_vma=True, its default).

There a value's type says which manual axes it varies over, and a primitive bound as it
is (not through a jnp function, which casts) takes operands that vary alike, a loop's
carry keeps its type, and a kernel's results need theirs. Outside such a shard_map no
value varies and both functions change nothing. No dependency on the rest of the
package: the mod evaluators (`masks.mod_program`, `kernels.tile_mods`) and the kernel
wrappers (`sharding`) share them.
"""

from __future__ import annotations

import jax


def varying_axes(*trees) -> tuple:
    """The manual mesh axes any array of `trees` varies over (sorted; empty outside a
    shard_map that checks them)."""
    axes = set()
    for x in jax.tree.leaves(trees):
        try:
            manual = jax.typeof(x).manual_axis_type
        except (AttributeError, TypeError):
            continue
        axes |= set(getattr(manual, "varying", ()) or ())
    return tuple(sorted(axes))


def vary(tree, axes):
    """`tree`'s arrays typed as varying over the manual mesh `axes` (`jax.lax.pcast`
    where they do not yet): a loop's initial state made from constants, the operands of
    a primitive that must vary alike, a cotangent for a varying result."""
    if not axes:
        return tree

    def one(x):
        have = varying_axes(x)
        missing = tuple(axis for axis in axes if axis not in have)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


__all__ = ["vary", "varying_axes"]
