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
could.

`call` runs one kernel call (the forward, or the backward) that way:

* q-shaped arrays [B, Sq, Hq, D] (q, out, d_out, dq), k-shaped ones [B, Skv, Hkv, D] (k, v,
  dk, dv), row statistics [B, Hq, Sq] (lse) and BlockMask tables [B or 1, Hq or 1, ...]
  keep the batch and head shardings they come with; the sequence and head-dim axes, and
  a batch or head axis that does not divide, are gathered (context parallelism, for a
  split sequence, is `pf.context_parallel_attention`).
* Arrays the mods capture are indexed at global (b, h), so every device reads them whole,
  and each device's mods see global batch rows and heads (its shard offsets are traced
  scalars, captured like any other array: one program serves every device).
* A captured array's gradient is each device's partial sum, summed over the mesh axes the
  batch and heads are split over (`jax.lax.psum`).

On one device, inside a `jax.shard_map` that makes every axis manual, and under
`jax.vmap` (custom_partitioning has no batching rule: the call is vmapped as it is), the
kernels run directly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from pallas_flex.masks.block_mask import BlockMask
from pallas_flex.masks.mod_program import MASK, SCORE, ModProgram, make_mod_program

# The shape roles of a call's arrays.
QUERY = "query"      # [B, Sq, Hq, ...]: q, out, d_out, dq
KEY = "key"          # [B, Skv, Hkv, ...]: k, v, dk, dv
ROW = "row"          # [B, Hq, Sq]: lse, its cotangent
TABLE = "table"      # [B or 1, Hq or 1, ...]: a BlockMask's tables
WHOLE = "whole"      # read whole on every device: captured arrays
SUM = "sum"          # a result summed over the shards: captured arrays' gradients


def roles_of(operand, role):
    """A pytree of roles shaped like `operand`: `role` for every leaf, except a BlockMask
    (tables TABLE, its mask_mod's captured arrays WHOLE) and a ModProgram (WHOLE)."""
    if isinstance(operand, BlockMask):
        children, treedef = jax.tree_util.tree_flatten(
            operand, is_leaf=lambda x: isinstance(x, ModProgram))
        return jax.tree_util.tree_unflatten(treedef, [
            roles_of(child, WHOLE) if isinstance(child, ModProgram)
            else (None if child is None else TABLE) for child in children])
    return jax.tree.map(lambda _: role, operand)


def call(function, operands, roles, result_roles, *, batch, q_heads, kv_heads):
    """`function(operands, offsets)`, partitioned over the batch and head shardings.

    Args:
      function: `(operands, (batch_offset, head_offset)) -> results`: one kernel call on
        a shard; the offsets (int32 scalars, or Python 0 where nothing is split) are the
        global index of its first batch row and query head, for its mods (`shift_mods`).
      operands: a tuple of pytrees of arrays (None leaves allowed).
      roles: per operand, its role (above) or a pytree of roles (`roles_of`).
      result_roles: a function of the results' pytree of shapes giving their roles.
      batch, q_heads, kv_heads: the call's B, Hq and Hkv.
    """
    if jax.device_count() == 1:
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
    if closed.effects:
        # Ordered side effects (the Mosaic GPU kernels in Pallas's interpreter call back
        # to the host in order) need tokens that custom_partitioning cannot thread:
        # such a call runs whole.
        return unsharded(*flat_operands)
    constants = list(closed.consts)
    result_leaves = jax.tree.leaves(result_roles(result_shape))
    group = q_heads // kv_heads
    sizes = dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads)

    def sharded(flat, batch_axes, head_axes):
        offsets = (_offset(batch_axes, flat, role_leaves, 0),
                   _offset(head_axes, flat, role_leaves, 2))
        results = function(jax.tree.unflatten(operand_tree, flat), offsets)
        split = batch_axes + head_axes
        flat_results, tree = jax.tree.flatten(results)
        return jax.tree.unflatten(tree, [
            jax.lax.psum(x, split) if role == SUM and split else x
            for x, role in zip(flat_results, result_leaves)])

    explicit_mesh = _explicit_mesh(flat_operands)
    if explicit_mesh is not None:
        # Shardings in the types (Explicit mesh axes): known now, so a shard_map runs
        # the shards, each operand first resharded to the layout the kernels take.
        spec = _spec_of(flat_operands[role_leaves.index(QUERY)])
        batch_axes = _divisible_axes(spec[0], explicit_mesh, batch)
        head_axes = _divisible_axes(spec[2], explicit_mesh, kv_heads)
        in_specs = [_spec(role, x.shape, batch_axes, head_axes, sizes)
                    for x, role in zip(flat_operands, role_leaves)]
        flat = [jax.sharding.reshard(x, NamedSharding(explicit_mesh, spec))
                for x, spec in zip(flat_operands, in_specs)]
        if not batch_axes + head_axes:
            return unsharded(*flat)
        flat_results, result_tree = jax.tree.flatten(result_shape)
        out_specs = [_spec(role, x.shape, batch_axes, head_axes, sizes)
                     for x, role in zip(flat_results, result_leaves)]
        # check_vma=False: the kernels' loops do not declare which values vary over
        # manual axes.
        run = jax.shard_map(
            lambda *flat: jax.tree.leaves(sharded(flat, batch_axes, head_axes)),
            mesh=explicit_mesh, in_specs=tuple(in_specs), out_specs=out_specs,
            check_vma=False)
        return jax.tree.unflatten(result_tree, run(*flat))

    def partition(mesh, arg_shapes, result_shape):
        query = next(a for a, role in zip(arg_shapes, role_leaves) if role == QUERY)
        spec = _spec_of(query)
        batch_axes = _divisible_axes(spec[0], mesh, batch)
        head_axes = _divisible_axes(spec[2], mesh, kv_heads)

        def shardings(shapes, roles):
            return [NamedSharding(mesh, _spec(role, x.shape, batch_axes, head_axes, sizes))
                    for x, role in zip(shapes, roles)]

        flat_results, result_tree = jax.tree.flatten(result_shape)
        return (mesh, lambda *flat: sharded(flat, batch_axes, head_axes),
                jax.tree.unflatten(result_tree, shardings(flat_results, result_leaves)),
                tuple(shardings(arg_shapes, role_leaves)))

    def sharding_rule(mesh, operand_types, result_types):
        del mesh, operand_types, result_types
        factors = _Factors(group, kv_heads)
        operands_rule = ", ".join(factors.of(role, shape) for role, shape in
                                  zip(role_leaves, _leaf_shapes(flat_operands)))
        results_rule = ", ".join(factors.of(role, shape) for role, shape in
                                 zip(result_leaves, _leaf_shapes(result_shape)))
        return (f"{operands_rule} -> {results_rule}",
                dict(need_replication_factors=tuple(factors.replicated), **factors.sizes))

    def from_jaxpr(*flat_and_constants):
        flat, constants = (flat_and_constants[:len(flat_operands)],
                           flat_and_constants[len(flat_operands):])
        return jax.tree.unflatten(result_tree,
                                  jax.core.eval_jaxpr(closed.jaxpr, constants, *flat))

    def partition_with_constants(mesh, arg_shapes, result_shape):
        mesh, lower, result_shardings, arg_shardings = partition(
            mesh, arg_shapes[:len(flat_operands)], result_shape)
        replicated = tuple(NamedSharding(mesh, PartitionSpec(*([None] * len(c.shape))))
                           for c in arg_shapes[len(flat_operands):])
        return (mesh, lambda *args: lower(*args[:len(flat_operands)]), result_shardings,
                arg_shardings + replicated)

    def sharding_rule_with_constants(mesh, operand_types, result_types):
        rule, options = sharding_rule(mesh, operand_types, result_types)
        factors = list(options["need_replication_factors"])
        operands_rule, results_rule = rule.split(" -> ")
        for constant in constants:
            names = [f"c{len(factors) + i}" for i in range(jnp.ndim(constant))]
            factors += names
            operands_rule += ", " + " ".join(names)
        rule = f"{operands_rule} -> {results_rule}"
        # Shardy wants special factors in the order they first appear in the rule.
        order = {name: i for i, name in reversed(list(enumerate(
            rule.replace("(", " ").replace(")", " ").replace(",", " ").split())))}
        options["need_replication_factors"] = tuple(sorted(factors, key=order.__getitem__))
        return rule, options

    partitioned = custom_partitioning(from_jaxpr)
    partitioned.def_partition(partition=partition_with_constants,
                              sharding_rule=sharding_rule_with_constants)

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
    # The new program closes over the old one's captured arrays themselves (and the
    # offsets): tracing keeps their identity, in an order of its own.
    old = {id(const): position for position, const in enumerate(score_program.consts)}
    return block_mask, new_program, [old.get(id(const)) for const in new_program.consts]


def _is_program(x):
    return isinstance(x, ModProgram)


def _leaf_shapes(tree):
    return [tuple(x.shape) for x in jax.tree.leaves(tree)]


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


def _spec(role, shape, batch_axes, head_axes, sizes):
    ndim = len(shape)
    if role in (QUERY, KEY):
        return PartitionSpec(_entry(batch_axes), None, _entry(head_axes), *([None] * (ndim - 3)))
    if role == ROW:
        return PartitionSpec(_entry(batch_axes), _entry(head_axes), None)
    if role == TABLE:
        return PartitionSpec(_entry(batch_axes) if shape[0] == sizes["batch"] else None,
                             _entry(head_axes) if shape[1] == sizes["q_heads"] else None,
                             *([None] * (ndim - 2)))
    return PartitionSpec(*([None] * ndim))


def _offset(axes, operands, role_leaves, dimension):
    """The global index of this shard's first batch row (dimension 0) or query head (2)."""
    if not axes:
        return 0
    query = next(x for x, role in zip(operands, role_leaves) if role == QUERY)
    return (jax.lax.axis_index(axes) * query.shape[dimension]).astype(jnp.int32)


class _Factors:
    """Shardy factor names for a call's dimensions: `b` batch, `g` KV heads, `r` query
    heads per KV head; every other dimension a factor of its own that must stay whole."""

    def __init__(self, group, kv_heads):
        self.group, self.kv_heads = group, kv_heads
        self.replicated = []
        # Shardy refuses size-1 factors in a compound dimension.
        self.sizes = {"r": group} if group > 1 and kv_heads > 1 else {}

    def _own(self):
        name = f"x{len(self.replicated)}"
        self.replicated.append(name)
        return name

    def _q_heads(self):
        if self.group == 1:
            return "g"
        return "(g r)" if self.kv_heads > 1 else "r"

    def _kv_heads(self):
        return "g" if self.kv_heads > 1 or self.group == 1 else self._own()

    def of(self, role, shape):
        ndim = len(shape)
        if role == QUERY:
            dims = ["b", self._own(), self._q_heads()] + [self._own() for _ in range(ndim - 3)]
        elif role == KEY:
            dims = ["b", self._own(), self._kv_heads()] + [self._own() for _ in range(ndim - 3)]
        elif role == ROW:
            dims = ["b", self._q_heads(), self._own()]
        elif role == TABLE:
            dims = ["b" if shape[0] != 1 else self._own(),
                    self._q_heads() if shape[1] != 1 else self._own()]
            dims += [self._own() for _ in range(ndim - 2)]
        else:
            dims = [self._own() for _ in range(ndim)]
        return " ".join(dims)
