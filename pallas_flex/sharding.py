"""Batch and head sharding: the kernels under `jax.jit` with inputs sharded over a mesh.

XLA's partitioner cannot see into a Pallas kernel: left alone, it would gather q, k and v
onto every device and run the whole call everywhere. Attention is independent per batch
row and per KV head (with its group of query heads), so each device can run the kernels
on its own rows and heads with no data moving at all. `jax.experimental.
custom_partitioning` is how a JAX op tells the partitioner so, and it is used here rather
than a `shard_map` the library would insert, because under `jit` with the default (Auto)
mesh axes the inputs' shardings are unknown while the function is traced: the
partitioner (Shardy) chooses them afterwards, and custom_partitioning is the hook it calls
then. It also sees shardings that come from inside the user's function (a
`with_sharding_constraint`, a sharded matmul producing q), which no trace-time check
could. With Explicit mesh axes the shardings are in the types, known while tracing: there
a `jax.shard_map` runs the shards.

`call` runs one kernel call (a forward, a backward, a paged or ragged op) that way. Each
array has a role saying what its dimensions index (the layouts below):

* batch and head dimensions keep the shardings they come with where the call's B (or
  Hkv) divides over their mesh axes; every other dimension, and a batch or head split
  that does not divide, is gathered (context parallelism, for a split sequence, is
  `pf.context_parallel_attention`). A split of the query heads is a split of their KV
  heads: Shardy is told Hq = Hkv x (Hq / Hkv).
* Arrays the mods capture are indexed at global (b, h), so every device reads them whole,
  and each device's mods see global batch rows and heads (its shard offsets are traced
  scalars, captured like any other array: one program serves every device).
* A captured array's gradient is each device's partial sum, summed over the mesh axes the
  batch and heads are split over (`jax.lax.psum`); so are the ragged op's scores.

On one device, inside a `jax.shard_map` that makes every axis manual, under `jax.vmap`
(custom_partitioning has no batching rule: the call is vmapped as it is), and for kernels
with ordered side effects (the Mosaic GPU kernels in Pallas's interpreter), the call runs
whole.
"""

from __future__ import annotations

import hashlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, ManualAxisType, NamedSharding, PartitionSpec

from pallas_flex.manual_axes import vary, varying_axes
from pallas_flex.masks.block_mask import BlockMask
from pallas_flex.masks.mod_program import (
    MASK, SCORE, ModProgram, const_positions, make_mod_program)

# What each dimension of an array indexes: "b" batch rows, "q" query heads, "kv" KV heads,
# "q*" / "kv*" heads times features flattened (split only between heads), None anything
# that stays whole. Trailing dimensions not listed stay whole.
_LAYOUTS = {
    "query": ("b", None, "q"),         # [B, Sq, Hq, D]: q, out, d_out, dq
    "key": ("b", None, "kv"),          # [B, Skv, Hkv, D]: k, v, dk, dv
    "row": ("b", "q"),                 # [B, Hq, Sq]: lse and its cotangent
    "pages": (None, "kv"),             # [pages, Hkv, page, D]: paged K/V
    "tokens": (None, "q*"),            # [T, Hq * D]: the ragged op's queries and output
    "token_kv": (None, "kv*"),         # [T, Hkv * D]: the ragged op's new keys and values
    "per_head": ("q",),                # [Hq]: a value per query head (ALiBi slopes)
    "whole": (),                       # read whole everywhere: captured arrays, metadata
    "sum": (),                         # a result summed over the shards
}
QUERY, KEY, ROW, PAGES, TOKENS, TOKEN_KV, PER_HEAD, WHOLE, SUM = _LAYOUTS
TABLE = "table"  # [B or 1, Hq or 1, ...]: a BlockMask's tables


def query_and_rows(results):
    """The result roles of an attention call: out [B, Sq, Hq, Dv], then rows [B, Hq, Sq]
    (lse, and the row max where asked)."""
    return (QUERY,) + (ROW,) * (len(results) - 1)


def typed_like(result_types, *inputs):
    """`result_types` (ShapeDtypeStructs) varying over the manual mesh axes `inputs`
    vary over: a kernel's results inside a shard_map that checks them."""
    axes = varying_axes(*inputs)
    if not axes:
        return result_types
    manual = ManualAxisType(varying=frozenset(axes))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=manual),
        result_types)


def typed_as_primals(cotangents, primals):
    """Cotangents typed as their primals vary, inside a shard_map that checks varying
    manual axes: summed (`jax.lax.psum`) over the axes a cotangent varies over and its
    primal does not (an array every device reads whole, such as ALiBi slopes, gets the
    sum of the devices' gradients, as JAX's own transpose of a broadcast does), cast to
    varying where the primal varies and the cotangent does not. Elsewhere unchanged."""
    def one(cotangent, primal):
        if not isinstance(cotangent, jax.Array) or not hasattr(primal, "shape"):
            return cotangent
        have, want = set(varying_axes(cotangent)), set(varying_axes(primal))
        extra = tuple(sorted(have - want))
        if extra and jnp.issubdtype(cotangent.dtype, jnp.inexact):
            cotangent = jax.lax.psum(cotangent, extra)
        return vary(cotangent, tuple(sorted(want - have)))

    return jax.tree.map(one, cotangents, primals, is_leaf=lambda x: x is None)


def refuse_varying_on_the_interpreter(what: str, *trees) -> None:
    """A ValueError on the "interpret" backend where arrays a kernel indexes (`trees`: a
    BlockMask's tables and a mod's captured arrays, or the ragged op's inputs) vary over
    manual mesh axes of a shard_map that checks them: Pallas's interpreter indexes them
    at its program ids, which do not vary, and JAX's check stops it. The "xla" backend
    runs those calls."""
    axes = varying_axes(*trees)
    if axes:
        raise ValueError(
            f"backend 'interpret' inside jax.shard_map with check_vma=True: {what} vary "
            f"over the manual mesh axes {list(axes)}, which Pallas's interpreter cannot "
            "index. Use backend='xla' there, or pass check_vma=False to jax.shard_map.")


def roles_of(operand, role):
    """A pytree of roles shaped like `operand`: `role` for every leaf, except a BlockMask
    (tables TABLE, its mask_mod's captured arrays WHOLE) and a ModProgram (WHOLE)."""
    if isinstance(operand, BlockMask):
        children, treedef = jax.tree_util.tree_flatten(
            operand, is_leaf=lambda x: isinstance(x, ModProgram))
        return jax.tree_util.tree_unflatten(treedef, [
            roles_of(child, WHOLE) if isinstance(child, ModProgram)
            else (None if child is None else TABLE) for child in children])
    if isinstance(operand, ModProgram):
        role = WHOLE
    return jax.tree.map(lambda _: role, operand)


def call(function, operands, roles, result_roles, *, batch, q_heads, kv_heads,
         split_batch=True):
    """`function(operands, offsets)`, partitioned over the batch and head shardings.

    Args:
      function: `(operands, (batch_offset, head_offset)) -> results`: one kernel call on
        a shard; the offsets (int32 scalars, or Python 0 where nothing is split) are the
        global index of its first batch row and query head, for its mods (`shift_mods`).
      operands: a tuple of pytrees of arrays (None leaves allowed).
      roles: per operand, its role (above) or a pytree of roles (`roles_of`).
      result_roles: a function of the results' pytree of shapes giving their roles.
      batch, q_heads, kv_heads: the call's B, Hq and Hkv.
      split_batch: False where batch rows share an array that cannot be split with them
        (a paged cache's page pool).
    """
    inside_shard_map = _inside_shard_map()
    explicit_mesh = None if inside_shard_map else _explicit_mesh(jax.tree.leaves(operands))
    if inside_shard_map or (jax.device_count() == 1 and explicit_mesh is None):
        return function(operands, (0, 0))
    role_leaves = [role for operand, role in zip(operands, roles)
                   for role in jax.tree.leaves(
                       role if not isinstance(role, str) else roles_of(operand, role))]
    flat_operands, operand_tree = jax.tree.flatten(operands)

    def unsharded(*flat):
        return function(jax.tree.unflatten(operand_tree, flat), (0, 0))

    # One trace of the whole call on unsharded types gives the results' shapes and the
    # function custom_partitioning runs where nothing is split; it takes no constants,
    # so the kernels' own (index arrays of Pallas's interpreter, say) become operands.
    closed, result_shape = jax.make_jaxpr(unsharded, return_shape=True)(
        *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat_operands])
    result_tree = jax.tree.structure(result_shape)

    def replay(flat, constants):  # the traced call, without tracing the kernels again
        return jax.tree.unflatten(result_tree,
                                  jax.core.eval_jaxpr(closed.jaxpr, constants, *flat))

    if closed.effects:  # ordered effects need tokens custom_partitioning cannot thread
        return replay(flat_operands, closed.consts)
    result_leaves = jax.tree.leaves(result_roles(result_shape))
    plan = _Plan(batch, q_heads, kv_heads, split_batch)
    # The traced call's constants, then its fingerprint (`_fingerprint`: the last operand,
    # which the shards ignore).
    constants = list(closed.consts) + [_fingerprint(closed, function, role_leaves,
                                                    result_leaves, plan)]
    constant_roles = [WHOLE] * len(constants)

    def sharded(flat, batch_axes, head_axes):
        offsets = (plan.offset(batch_axes, batch), plan.offset(head_axes, q_heads))
        results = function(jax.tree.unflatten(operand_tree, flat), offsets)
        split = batch_axes + head_axes
        flat_results, tree = jax.tree.flatten(results)
        return jax.tree.unflatten(tree, [
            jax.lax.psum(x, split) if role == SUM and split else x
            for x, role in zip(flat_results, result_leaves)])

    if explicit_mesh is not None:
        # Shardings in the types (Explicit mesh axes): known now, so a shard_map runs
        # the shards, each operand first resharded to the layout the kernels take. Also
        # where nothing is split (a mesh of one device, replicated operands): the kernels
        # are written for arrays without sharded types, which only a shard_map gives.
        batch_axes, head_axes = plan.axes(explicit_mesh, flat_operands, role_leaves)
        in_specs = [plan.spec(role, x.shape, batch_axes, head_axes)
                    for x, role in zip(flat_operands, role_leaves)]
        flat = [jax.sharding.reshard(x, NamedSharding(explicit_mesh, spec))
                for x, spec in zip(flat_operands, in_specs)]
        out_specs = [plan.spec(role, x.shape, batch_axes, head_axes)
                     for x, role in zip(jax.tree.leaves(result_shape), result_leaves)]
        # check_vma=False: the kernels' loops do not declare which values vary over
        # manual axes.
        run = jax.shard_map(
            lambda *flat: jax.tree.leaves(sharded(flat, batch_axes, head_axes)),
            mesh=explicit_mesh, in_specs=tuple(in_specs), out_specs=out_specs,
            check_vma=False)
        return jax.tree.unflatten(result_tree, run(*flat))

    def from_jaxpr(*flat_and_constants):
        return replay(flat_and_constants[:len(flat_operands)],
                      flat_and_constants[len(flat_operands):-1])

    def partition(mesh, arg_shapes, result_shape):
        batch_axes, head_axes = plan.axes(mesh, arg_shapes, role_leaves)

        def shardings(shapes, roles):
            return [NamedSharding(mesh, plan.spec(role, x.shape, batch_axes, head_axes))
                    for x, role in zip(shapes, roles)]

        flat_results, tree = jax.tree.flatten(result_shape)
        return (mesh,
                lambda *args: sharded(args[:len(flat_operands)], batch_axes, head_axes),
                jax.tree.unflatten(tree, shardings(flat_results, result_leaves)),
                tuple(shardings(arg_shapes, role_leaves + constant_roles)))

    def sharding_rule(mesh, operand_types, result_types):
        del mesh, operand_types, result_types
        return plan.shardy_rule(
            list(zip(role_leaves + constant_roles,
                     _leaf_shapes(flat_operands) + _leaf_shapes(constants))),
            list(zip(result_leaves, _leaf_shapes(result_shape))))

    partitioned = custom_partitioning(from_jaxpr)
    partitioned.def_partition(partition=partition, sharding_rule=sharding_rule)

    # custom_partitioning has no batching rule: under jax.vmap the call runs unsharded.
    @jax.custom_batching.custom_vmap
    def run(*flat):
        return partitioned(*flat, *constants)

    @run.def_vmap
    def run_vmapped(axis_size, in_batched, *flat):
        del axis_size
        results = jax.vmap(unsharded, in_axes=[0 if b else None for b in in_batched])(*flat)
        return results, jax.tree.map(lambda _: True, results)

    return run(*flat_operands)


def _fingerprint(closed, function, role_leaves, result_leaves, plan):
    """uint32 [8]: a digest of what a custom-partitioned call computes (its traced jaxpr,
    the code that traces its shards, the roles and the split plan), passed to it as a
    constant operand so that the program's text says what runs inside it.

    custom_partitioning lowers to a custom call whose body is in Python: the program's
    text names it only by the address of its callbacks (`id` of an object), and JAX's
    persistent compilation cache keys executables on that text. Two processes (or one,
    once an address is reused) that compile different calls of the same shapes can get
    the same address, hence the same key, and the second would load the first's
    executable: a wrong answer from any cache a user turns on (and from the test suite's,
    which once failed so). With the digest in the text the keys differ where the bodies
    do. Addresses printed in the jaxpr (functions in primitives' parameters) are left
    out, so that the same call keeps its key across processes."""
    code = getattr(function, "__code__", None)
    text = "\n".join([
        re.sub(r" at 0x[0-9a-f]+", "", str(closed.jaxpr)),
        f"{code.co_filename}:{code.co_firstlineno}" if code is not None
        else getattr(function, "__qualname__", type(function).__qualname__),
        repr((role_leaves, result_leaves, plan.batch, plan.q_heads, plan.kv_heads,
              plan.split_batch))])
    return np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint32)


def shift_mods(block_mask, score_program, offsets):
    """The BlockMask and score program of a shard whose first batch row and query head
    are `offsets` in the whole call, so that the mods see global b and h; and, per
    captured array of the new score program, its position among the old one's (None for
    the offsets), for mapping gradients back."""
    batch_offset, head_offset = offsets
    identity = list(range(len(score_program.consts))) if score_program is not None else []
    if isinstance(batch_offset, int) and isinstance(head_offset, int):
        return block_mask, score_program, identity

    def shifted(program, kind):
        if program is None or not (program.uses_batch or program.uses_head):
            return program
        if kind == MASK:
            def mod(b, h, q_idx, kv_idx):
                return program(b + batch_offset, h + head_offset, q_idx, kv_idx)
        else:
            def mod(score, b, h, q_idx, kv_idx):
                return program(score, b + batch_offset, h + head_offset, q_idx, kv_idx)
        mod.__name__ = program.name
        return make_mod_program(mod, kind)

    if block_mask is not None:
        block_mask = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(block_mask, is_leaf=_is_program),
            [shifted(child, MASK) if _is_program(child) else child for child in
             jax.tree_util.tree_leaves(block_mask, is_leaf=_is_program)])
    new_program = shifted(score_program, SCORE)
    if new_program is score_program:
        return block_mask, score_program, identity
    return block_mask, new_program, const_positions(score_program, new_program)


class _Plan:
    """Which mesh axes split a call's batch and heads, and what that makes of each
    array's sharding and of Shardy's rule."""

    def __init__(self, batch, q_heads, kv_heads, split_batch):
        self.batch, self.q_heads, self.kv_heads = batch, q_heads, kv_heads
        self.split_batch = split_batch

    def tags(self, role, shape):
        """The dimension tags of an array of `role` and `shape`."""
        if role == TABLE:
            return ("b" if shape[0] == self.batch else None,
                    "q" if shape[1] == self.q_heads else None) + (None,) * (len(shape) - 2)
        layout = _LAYOUTS[role]
        return layout + (None,) * (len(shape) - len(layout))

    def axes(self, mesh, arrays, roles):
        """(batch axes, head axes) from the first array with a batch / head dimension:
        its axes where the call's B and Hkv (hence Hq) divide over them, else none."""
        batch_axes = head_axes = None
        for array, role in zip(arrays, roles):
            spec = _spec_of(array)
            for tag, entry in zip(self.tags(role, array.shape), spec):
                if tag == "b" and batch_axes is None and role != TABLE:
                    batch_axes = _divisible_axes(entry, mesh, self.batch)
                if tag in ("q", "q*") and head_axes is None and role != TABLE:
                    head_axes = _divisible_axes(entry, mesh, self.kv_heads)
        batch_axes = batch_axes if batch_axes and self.split_batch else ()
        return batch_axes, head_axes or ()

    def spec(self, role, shape, batch_axes, head_axes):
        entries = {"b": _entry(batch_axes), "q": _entry(head_axes), "kv": _entry(head_axes),
                   "q*": _entry(head_axes), "kv*": _entry(head_axes), None: None}
        return PartitionSpec(*(entries[tag] for tag in self.tags(role, shape)))

    def offset(self, axes, size):
        """The global index of this shard's first batch row or query head."""
        if not axes:
            return 0
        count = math.prod(jax.lax.axis_size(axis) for axis in axes)
        return (jax.lax.axis_index(axes) * (size // count)).astype(jnp.int32)

    def shardy_rule(self, operands, results):
        """Shardy's sharding rule: `b` batch, `g` KV heads, `r` query heads per KV head,
        `f<i>` the features of a flattened heads dimension; every other dimension a
        factor of its own that must stay whole (need_replication)."""
        group = self.q_heads // self.kv_heads
        own, compound_sizes, standalone = [], {}, set()

        def whole(size):
            own.append(f"x{len(own)}")
            return own[-1]

        def heads(members, size):
            # Shardy refuses size-1 members in a compound dimension.
            members = [(name, n) for name, n in members if n > 1]
            if not members:
                return whole(size)
            if len(members) == 1:
                standalone.add(members[0][0])
                return members[0][0]
            compound_sizes.update(members)
            return "(" + " ".join(name for name, _ in members) + ")"

        def dimension(tag, size):
            if tag == "b" and size > 1:
                standalone.add("b")
                return "b"
            if tag == "q":
                return heads([("g", self.kv_heads), ("r", group)], size)
            if tag == "kv":
                return heads([("g", self.kv_heads)], size)
            if tag in ("q*", "kv*"):
                heads_count = self.q_heads if tag == "q*" else self.kv_heads
                features = f"f{len(own)}"
                own.append(features)
                return heads([("g", self.kv_heads)] + ([("r", group)] if tag == "q*" else [])
                             + [(features, size // heads_count)], size)
            return whole(size)

        def value(role, shape):
            return " ".join(dimension(tag, size)
                            for tag, size in zip(self.tags(role, shape), shape))

        rule = (", ".join(value(role, shape) for role, shape in operands) + " -> "
                + ", ".join(value(role, shape) for role, shape in results))
        # Shardy wants the special factors in the order they first appear in the rule,
        # and sizes for exactly the factors that appear only inside compound dimensions.
        order = {name: i for i, name in reversed(list(enumerate(
            rule.replace("(", " ").replace(")", " ").replace(",", " ").replace("->", " ")
            .split())))}
        replicated = sorted((name for name in own if name in order), key=order.__getitem__)
        sizes = {name: n for name, n in compound_sizes.items() if name not in standalone}
        return rule, dict(need_replication_factors=tuple(replicated), **sizes)


def _is_program(x):
    return isinstance(x, ModProgram)


def _leaf_shapes(tree):
    return [tuple(jnp.shape(x)) for x in jax.tree.leaves(tree)]


def _inside_shard_map():
    """Whether every axis of the mesh in context is manual: inside such a
    `jax.shard_map` every array is one device's already."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and set(mesh.manual_axes) == set(mesh.axis_names)


def _explicit_mesh(flat_operands):
    """The mesh of an operand's type with Explicit axes, or None."""
    for x in flat_operands:
        sharding = jax.typeof(x).sharding
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not mesh.empty and any(
                axis_type == AxisType.Explicit for axis_type in mesh.axis_types):
            return mesh
    return None


def _spec_of(arg):
    """A spec entry per dimension: from the partitioner's ShapeDtypeStruct or the type."""
    sharding = getattr(arg, "sharding", None)
    if sharding is None or isinstance(arg, jax.core.Tracer):
        sharding = jax.typeof(arg).sharding
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (len(arg.shape) - len(spec))


def _axes(entry):
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _divisible_axes(entry, mesh, size):
    """The mesh axes of a spec entry, if the dimension (of `size`) splits over them."""
    axes = _axes(entry)
    count = math.prod(mesh.shape[axis] for axis in axes)
    return axes if axes and size % count == 0 else ()


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes
