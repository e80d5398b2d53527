"""A matched attention (`match.Attention`) as one `pf.attention` call: q, k, v laid out
[B, S, H, D], the masking predicates as a mask_mod and the elementwise ops on the scores
as a score_mod, both evaluated at scalar (b, h, q_idx, kv_idx) by re-binding the graph's
own primitives; arrays read on the way become captured arrays (with their gradients)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flex.fuse.graph import Const, Value, bind
from pallas_flex.fuse.match import ELEMENTWISE, free_dims, reshape_roles

SUPPORTED = (jnp.float32, jnp.bfloat16, jnp.float16)


class Unsupported(Exception):
    pass


def _canonical(x, leading_dims, sequence_dims, feature_dims):
    """x transposed to (leading dims..., sequence, feature), size-1 free dims dropped."""
    (sequence,), (feature,) = sequence_dims, feature_dims
    others = [d for d in range(x.ndim) if d not in (*leading_dims, sequence, feature)]
    x = jnp.transpose(x, (*leading_dims, sequence, feature, *others))
    return x.reshape(x.shape[:len(leading_dims) + 2])


def _batch_index(role):
    """Where a batch dim of p goes among the product's batch dims: its own index, or
    first for a size-1 dim whose role was lost (any place holds a dim of one)."""
    return role[1] if isinstance(role, tuple) else -1


def _to_bshd(x, batch, heads):
    """(leading dims..., S, D) with batch * heads elements in the leading dims ->
    [B, S, H, D]."""
    return jnp.swapaxes(x.reshape((batch, heads) + x.shape[-2:]), 1, 2)


def _operand_dims(node, operand):
    """(batch dims in canonical order + the group dim, [sequence dim], contracting dims)
    of a product's operand; the group dim is the long free dim that is not the sequence
    (`match._product_roles` took the longer as the sequence)."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    contracting, batch = (lc, lb) if operand == 0 else (rc, rb)
    x = node.inputs[operand]
    free = [d for d in free_dims(x.shape, contracting, batch) if x.shape[d] != 1]
    sequence = max(free, key=lambda d: (x.shape[d], d))
    group = [d for d in free if d != sequence]
    return list(batch) + group, [sequence], list(contracting)


def build(attention, read, options, producers):
    """The p.v product's outputs, computed by pf.attention (`read` gives the runtime
    value of a graph Value)."""
    from pallas_flex.api import attention as pf_attention

    qk, pv = attention.qk, attention.pv
    logit_roles = attention.roles[attention.logits]
    # From the product itself (its batch dims lead): the logits lose the roles of
    # size-1 dims, the product has them all.
    (_, _), (qk_batch, _) = qk.params["dimension_numbers"]
    batch_sizes = list(qk.outputs[0].shape[:len(qk_batch)])

    group = next((size for size, role in zip(attention.logits.shape, logit_roles)
                  if role == ("g", 0)), None)
    batch = math.prod(batch_sizes[:-1])
    kv_heads = batch_sizes[-1] if batch_sizes else 1
    q_heads = kv_heads * (group or 1)
    q_batch, q_free, q_contract = _operand_dims(qk, attention.q_operand)
    k_batch, k_free, k_contract = _operand_dims(qk, 1 - attention.q_operand)
    if len(q_contract) != 1:
        raise Unsupported("q.k contracts more than one feature dimension")
    q = _to_bshd(_canonical(read(qk.inputs[attention.q_operand]), q_batch, q_free,
                            q_contract), batch, q_heads)
    k_value = qk.inputs[1 - attention.q_operand]
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    p_operand = attention.p_operand
    p_batch, v_batch = (lb, rb) if p_operand == 0 else (rb, lb)
    v_contract = rc if p_operand == 0 else lc
    p_roles = attention.roles[attention.probabilities]
    v_value = pv.inputs[1 - p_operand]
    order = sorted(range(len(p_batch)), key=lambda j: _batch_index(p_roles[p_batch[j]]))
    v_free = [d for d in free_dims(v_value.shape, v_contract, v_batch)
              if v_value.shape[d] != 1]
    # The head dim of k and of v: the one paired with the product's last batch dim.
    head = len(qk_batch) - 1
    k_head = k_batch[head] if qk_batch else None
    v_head = next((v_batch[j] for j in range(len(p_batch))
                   if p_roles[p_batch[j]] == ("b", head)), None)
    k_array, v_array, repeat = _unrepeated(k_value, k_head, v_value, v_head, read,
                                           producers)
    attention.kv_repeat = repeat
    k = _to_bshd(_canonical(k_array, k_batch, k_free, k_contract), batch,
                 kv_heads // repeat)
    v = _to_bshd(_canonical(v_array, [v_batch[j] for j in order], list(v_contract),
                            v_free), batch, kv_heads // repeat)
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or dtypes.pop() not in map(jnp.dtype, SUPPORTED):
        raise Unsupported(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}: pallas_flex "
                          "takes one of float32, bfloat16, float16 for all three")

    # [B, Sq, H, Dv] <-> (batch..., [group], Sq, Dv) <-> the p.v product's own layout.
    result = pv.outputs[0]
    canonical_shape = (tuple(batch_sizes) + ((group,) if group else ())
                       + (q.shape[1], v.shape[3]))
    canonical = ([("b", i) for i in range(len(batch_sizes))] +
                 ([("g", 0)] if group else []) + ["q", "dv"])
    target = _pv_output_roles(pv, p_operand, p_roles, v_value, v_contract, v_batch)
    # Size-1 dims dropped on both sides (the target may not know their roles), the
    # final reshape puts them back where the product has them.
    long = [r for r, size in zip(canonical, canonical_shape) if size != 1]
    squeezed = [size for size in canonical_shape if size != 1]
    permutation = [long.index(r) for r in target if r in long]

    def to_product_layout(out):
        out = jnp.swapaxes(out, 1, 2).reshape(canonical_shape)
        return jnp.transpose(out.reshape(squeezed), permutation).reshape(result.shape)

    def from_product_layout(x):
        x = jnp.transpose(x.reshape([squeezed[p] for p in permutation]),
                          _inverse(permutation))
        return jnp.swapaxes(x.reshape((batch, q_heads) + canonical_shape[-2:]), 1, 2)

    gate, passed = None, ()
    if attention.gate is not None:  # the multiply's gate, in the output's layout
        passed = attention.gate.layout
        gate = read(attention.gate.gate)
        for node in passed[::-1]:  # back through the layout ops after the product
            gate = _undo_layout(node, gate)
        gate = from_product_layout(gate)
    mods = _Mods(attention, read, batch_sizes, group, producers)
    out = to_product_layout(pf_attention(
        q, k, v, mask_mod=mods.mask_mod(), score_mod=mods.score_mod(),
        scale=attention.scale, output_gate=gate, **options)).astype(result.dtype)
    for node in passed:  # the product's layout ops, as written
        out = bind(node, [out])[0]
    final = result if attention.gate is None else attention.gate.multiply.outputs[0]
    return [out.astype(final.dtype)]


def _undo_layout(node, x):
    """x in the layout of `node`'s input, given it in the layout of its output (a
    transpose, reshape or cast after the p.v product)."""
    if node.name == "transpose":
        return jnp.transpose(x, _inverse(node.params["permutation"]))
    if node.name == "reshape":
        return x.reshape(node.inputs[0].shape)
    return x  # a cast: the gate keeps its own dtype


def _inverse(permutation):
    """The permutation that undoes `jnp.transpose(x, permutation)`."""
    return [list(permutation).index(d) for d in range(len(permutation))]


# Between a repeat and the product: ops that commute with it, re-bound on the source.
_AFTER_REPEAT = ("convert_element_type", "transpose", "copy", "copy_p")


def _repeat_of(value, head, producers):
    """(source, factor, ops) if `value` is `jnp.repeat(source, factor, axis)` along its
    dim `head`, through `ops` (casts, transposes) applied after the repeat; else None.

    jnp.repeat traces as broadcast_in_dim inserting a size-factor axis right after the
    repeated one, then a reshape merging the two: head i of the result is source head
    i // factor. (Inserting it before, as tiling does, gives i % heads: not taken.)"""
    ops = []
    while isinstance(value, Value) and value in producers and \
            producers[value].name in _AFTER_REPEAT:
        node = producers[value]
        if node.name == "transpose":
            head = node.params["permutation"][head]
        ops.append(node)
        value = node.inputs[0]
    reshape = producers.get(value) if isinstance(value, Value) else None
    if reshape is None or reshape.name != "reshape" or \
            reshape.params.get("dimensions") is not None:
        return None
    widened = reshape.inputs[0]
    shape = value.shape
    if not isinstance(widened, Value) or len(widened.shape) != len(shape) + 1 or \
            widened.shape[:head] != shape[:head] or \
            widened.shape[head + 2:] != shape[head + 1:]:
        return None
    heads, factor = widened.shape[head:head + 2]
    broadcast = producers.get(widened)
    if broadcast is None or broadcast.name != "broadcast_in_dim" or \
            heads * factor != shape[head]:
        return None
    source = broadcast.inputs[0]
    kept = tuple(d for d in range(len(widened.shape)) if d != head + 1)
    if tuple(broadcast.params["broadcast_dimensions"]) != kept or \
            tuple(source.shape) != tuple(widened.shape[d] for d in kept):
        return None
    return source, factor, ops[::-1]


def _unrepeated(k_value, k_head, v_value, v_head, read, producers):
    """(k, v, factor): k and v read from under a `jnp.repeat` of their heads by the
    same factor (the call then takes them with native GQA: query head h reads KV head
    h // (Hq / Hkv), jnp.repeat's own order), or as they are (factor 1) where either is
    not such a repeat, or the two factors differ."""
    found = [None if head is None else _repeat_of(value, head, producers)
             for value, head in ((k_value, k_head), (v_value, v_head))]
    if None in found or found[0][1] != found[1][1] or found[0][1] == 1:
        return read(k_value), read(v_value), 1
    arrays = []
    for source, _, ops in found:
        x = read(source)
        for node in ops:  # what the code did to the repeated array, on the source
            x = bind(node, [x])[0]
        arrays.append(x)
    return arrays[0], arrays[1], found[0][1]


class _Index:
    """The index each role takes at pallas_flex's (b, h, q_idx, kv_idx), computed when
    read (a mod that never reads b must not compute from it: its BlockMask would be built
    per batch row): b is the batch dims but the last, flattened; h the last batch dim
    (times the group of query heads sharing a KV head, if any)."""

    def __init__(self, b, h, q_idx, kv_idx, batch_sizes, group):
        self.values = {"q": q_idx, "kv": kv_idx}
        self.b, self.h, self.sizes, self.group = b, h, batch_sizes, group

    def __getitem__(self, role):
        if role is None:
            return jnp.int32(0)
        if role in self.values:
            return self.values[role]
        kind, i = role
        if kind == "g":
            return self.h % self.group
        last = len(self.sizes) - 1
        if i == last:
            return self.h // self.group if self.group else self.h
        if last == 1:  # two batch dims: b is the first one itself
            return self.b
        stride = math.prod(self.sizes[i + 1:last])
        return (self.b // stride) % self.sizes[i]


def _constant_at(value, roles, index, captured):
    """A constant array of the traced code (a NumPy array: positions that code built with
    np.arange, as jax.nn.dot_product_attention's window and length masks do) at the
    indices the roles take. Integers in a progression start + step * i along their one
    dim of more than one element are that arithmetic on the index (no table for the
    kernels to read); any other constant is captured as an array, once (`captured`: the
    arrays made so far, by the constant's id), however many reads it has."""
    array = np.asarray(value)
    varying = [dim for dim, size in enumerate(array.shape) if size != 1]
    if len(varying) == 1 and np.issubdtype(array.dtype, np.integer):
        line = array.reshape(-1).astype(np.int64)
        start, step = int(line[0]), int(line[1] - line[0])
        if np.array_equal(line, start + step * np.arange(line.size)):
            position = index[roles[varying[0]]]
            position = position * step if step != 1 else position
            position = position + start if start else position
            return position.astype(array.dtype)
    if id(value) not in captured:  # a concrete array, whichever trace the mod runs in
        with jax.ensure_compile_time_eval():
            captured[id(value)] = (value, jnp.asarray(array))  # (value kept: its id stays)
    return captured[id(value)][1][tuple(index[r] for r in roles)]


def _pv_output_roles(pv, p_operand, p_roles, v_value, v_contract, v_batch):
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    p_value = pv.inputs[p_operand]
    p_contract, p_batch = (lc, lb) if p_operand == 0 else (rc, rb)
    batch = [p_roles[d] for d in p_batch]
    p_free = [p_roles[d] for d in free_dims(p_value.shape, p_contract, p_batch)]
    v_free = ["dv" if v_value.shape[d] != 1 else None
              for d in free_dims(v_value.shape, v_contract, v_batch)]
    return batch + (p_free + v_free if p_operand == 0 else v_free + p_free)


class _Mods:
    """The mask_mod and score_mod of a matched attention, from its graph."""

    def __init__(self, attention, read, batch_sizes, group, producers):
        self.attention = attention
        self.read = read
        self.batch_sizes = batch_sizes
        self.group = group
        self.producers = producers
        self._constants = {}

    def mask_mod(self):
        if not self.attention.predicates:
            return None

        def mask_mod(b, h, q_idx, kv_idx):
            index = self._index(b, h, q_idx, kv_idx)
            keep = None
            for predicate, negate in self.attention.predicates:
                value = self._scalar(predicate, self.attention.roles[self.attention.logits],
                                     index, None).astype(bool)
                value = ~value if negate else value
                keep = value if keep is None else keep & value
            return keep
        return mask_mod

    def score_mod(self):
        attention = self.attention
        if not attention.has_score_mod:
            return None

        def score_mod(score, b, h, q_idx, kv_idx):
            index = self._index(b, h, q_idx, kv_idx)
            value = self._scalar(attention.score_value, attention.roles[attention.score_value],
                                 index, score)
            return value.astype(jnp.float32)
        return score_mod

    def _index(self, b, h, q_idx, kv_idx):
        return _Index(b, h, q_idx, kv_idx, self.batch_sizes, self.group)

    def _scalar(self, x, roles, index, score):
        """x's element at the dims' indices (roles say which index each dim takes)."""
        attention = self.attention
        if isinstance(x, Const) and not x.shape:
            return jnp.asarray(x.value)
        # The kernel's score is the product times attention.scale: the graph's `scaled`.
        if attention.scaled is not None and x is attention.scaled:
            return score.astype(x.dtype)
        if x is attention.qk.outputs[0]:  # the scores, in the product's dtype
            scale = attention.scale
            return (score if scale == 1.0 else score / scale).astype(x.dtype)
        node = self.producers.get(x) if isinstance(x, Value) else None
        if node is not None:
            result = self._through(node, x, roles, index, score)
            if result is not None:
                return result
        if x in attention.roles:
            raise Unsupported(f"the scores pass through {node.name if node else '?'}")
        value = x.value if isinstance(x, Const) else self.read(x)
        if not jnp.shape(value):
            return jnp.asarray(value)
        if isinstance(x, Const) or isinstance(value, np.ndarray):  # (the jaxpr's constants)
            return _constant_at(value, roles, index, self._constants)
        return value[tuple(index[r] for r in roles)]  # a captured array, read at (b, h, q, kv)

    def _through(self, node, x, roles, index, score):
        name = node.name
        if name == "broadcast_in_dim":
            source = node.inputs[0]
            dims = node.params["broadcast_dimensions"]
            inner = tuple(roles[d] if source.shape[i] == x.shape[d] else None
                          for i, d in enumerate(dims))
            return self._scalar(source, inner, index, score)
        if name == "iota":
            return index[roles[node.params["dimension"]]].astype(node.params["dtype"])
        if name == "transpose":
            inner = [None] * len(roles)
            for j, p in enumerate(node.params["permutation"]):
                inner[p] = roles[j]
            return self._scalar(node.inputs[0], tuple(inner), index, score)
        if name in ("reshape", "squeeze"):
            inner = reshape_roles(roles, x.shape, node.inputs[0].shape)
            if inner is None:
                return None
            return self._scalar(node.inputs[0], inner, index, score)
        if name in ELEMENTWISE and len(node.outputs) == 1:
            arguments = []
            for source in node.inputs:
                if not source.shape:
                    arguments.append(self._scalar(source, (), index, score))
                    continue
                if len(source.shape) != len(x.shape):
                    return None
                inner = tuple(r if s == t else None
                              for r, s, t in zip(roles, source.shape, x.shape))
                arguments.append(self._scalar(source, inner, index, score))
            return bind(node, arguments)[0]
        return None
