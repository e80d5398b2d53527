"""Reads of captured arrays at computed indices of one position, made into plain reads.

A mask such as `ids[q_idx] == ids[kv_idx]` (documents) reads its array at the positions
themselves: the Mosaic GPU kernels load such a read as a vector of the block's rows or
columns. A read at a computed index (`ids[q_idx // 2]`; context parallelism's
`ids[q_position(q_idx)]`, a select of two offsets under zig-zag, q_idx * N + i striped)
is a per-element gather, which sends the whole call to the Triton kernels (measured on
2 H100s at 256k tokens, 16 documents, all-gather: 85 % parallel efficiency on Triton,
95 % with this).

But such a read depends on one position only (and on b, h): `precompute_row_reads`
evaluates it once per row (and column) outside the kernel, a vector over the call's
[B, H,] Sq (or Skv) made with `jax.vmap`, and gives a program that reads that vector at
q_idx (kv_idx) instead: a plain read again. Only values that read an array are
precomputed (arithmetic on the positions stays in the kernel), and only in mask
programs (a score program's captured arrays may need gradients, which would stop at the
new vectors). `dispatch.mask_for_kernels` applies it to the masks of the BlockMasks the
entry points build, where the Mosaic kernels refuse the mask and take the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from pallas_flex.masks.mod_program import MASK, ModProgram, eval_inline, make_mod_program

__all__ = ["precompute_row_reads"]

# The mod's index arguments, by position among (b, h, q_idx, kv_idx).
_BATCH, _HEAD, _QUERY, _KEY = range(4)


def _flat(program):
    """The mask program's jaxpr with its calls inlined (one flat jaxpr), and its consts:
    the program's captured arrays (as they are: traced values keep their types) and any
    arrays the inlined calls held."""
    index = jax.ShapeDtypeStruct((), jnp.int32)
    closed = jax.make_jaxpr(lambda *args: eval_inline(program.jaxpr, program.consts, args))(
        *[index] * 4)
    return closed.jaxpr, closed.consts


def _roots(jaxpr):
    """{var: the index arguments (positions among b, h, q_idx, kv_idx) it depends on} for
    each value worth precomputing: it depends on exactly one of q_idx / kv_idx (and maybe
    b, h), and on a captured array of at least one axis (a read), and is used where more
    of the indices take part, or is the mod's result."""
    depends = {var: frozenset([position]) for position, var in enumerate(jaxpr.invars)}
    reads = {var for var in jaxpr.constvars if var.aval.ndim >= 1}

    def tag(atom):
        return (frozenset() if isinstance(atom, jex_core.Literal)
                else depends.get(atom, frozenset()))
    uses = []
    for equation in jaxpr.eqns:
        joined = frozenset().union(*[tag(atom) for atom in equation.invars])
        from_array = any(not isinstance(atom, jex_core.Literal) and atom in reads
                         for atom in equation.invars)
        for var in equation.outvars:
            depends[var] = joined
            if from_array:
                reads.add(var)
        uses.append((equation.invars, joined))

    def single(atom):
        return (not isinstance(atom, jex_core.Literal) and atom in reads
                and atom.aval.ndim == 0 and len(tag(atom) & {_QUERY, _KEY}) == 1)
    roots = {}
    for invars, joined in uses:
        for atom in invars:
            if single(atom) and tag(atom) != joined:
                roots[atom] = tuple(sorted(tag(atom)))
    for atom in jaxpr.outvars:
        if single(atom):
            roots[atom] = tuple(sorted(tag(atom)))
    return roots


def _evaluator(jaxpr, consts, outvars, replaced):
    """f(args) -> the values of `outvars` of the flat jaxpr, each computed on demand (what
    only a replaced value needs is never evaluated); `replaced(var)` gives a root's
    value, or None to compute it."""
    producers = {var: equation for equation in jaxpr.eqns for var in equation.outvars}

    def run(args):
        environment = dict(zip(jaxpr.constvars, consts))
        environment.update(zip(jaxpr.invars, args))

        def value(atom):
            if isinstance(atom, jex_core.Literal):
                return atom.val
            if atom not in environment:
                given = replaced(atom)
                if given is not None:
                    environment[atom] = given
                else:
                    equation = producers[atom]
                    outputs = equation.primitive.bind(
                        *[value(x) for x in equation.invars], **equation.params)
                    if not equation.primitive.multiple_results:
                        outputs = [outputs]
                    environment.update(zip(equation.outvars, outputs))
            return environment[atom]
        return [value(atom) for atom in outvars]
    return run


def precompute_row_reads(program: ModProgram | None, batch: int, heads: int, q_len: int,
                         kv_len: int) -> ModProgram | None:
    """`program` with each value that reads a captured array at an index computed from
    one position (q_idx or kv_idx, and maybe b, h) replaced by a read of a precomputed
    vector at that position: [.., Sq] or [.., Skv], with leading axes for b / h where the
    value depends on them. The program itself where there is no such value, or where it
    is not a mask program (a score program's captured arrays may need gradients)."""
    if program is None or program.kind != MASK or not program.consts:
        return program
    jaxpr, consts = _flat(program)
    roots = _roots(jaxpr)
    if not roots:
        return program
    sizes = (batch, heads, q_len, kv_len)
    vectors = {}
    for positions in sorted(set(roots.values())):
        group = [var for var, used in roots.items() if used == positions]

        def at(*indices, group=group, positions=positions):
            args = [jnp.int32(0)] * 4
            for position, index in zip(positions, indices):
                args[position] = index
            return _evaluator(jaxpr, consts, group, lambda var: None)(args)
        function = at
        for axis in reversed(range(len(positions))):  # one vmap per index it depends on
            function = jax.vmap(function, in_axes=tuple(
                0 if other == axis else None for other in range(len(positions))))
        values = function(*[jnp.arange(sizes[p], dtype=jnp.int32) for p in positions])
        vectors.update(zip(group, values))

    def mod(b, h, q_idx, kv_idx):
        indices = (b, h, q_idx, kv_idx)

        def replaced(var):
            if var not in vectors:
                return None
            return vectors[var][tuple(indices[p] for p in roots[var])]
        (result,) = _evaluator(jaxpr, consts, jaxpr.outvars, replaced)(indices)
        return result
    mod.__name__ = program.name
    return make_mod_program(mod, MASK)
