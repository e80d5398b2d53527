"""Finding attention in a flat graph (`graph.py`): each softmax, and whether it is the
middle of `dot_general(q, k) -> elementwise ops -> softmax -> dot_general(., v)` that a
pallas_flex call can take over.

Every value computed from the scores carries *roles*, one per dimension: `("b", i)` for
the i-th batch dimension of the q.k product, "L" / "R" for its left and right operand's
free (sequence) dimension, None for a dimension of size 1. Elementwise ops, transposes
and reshapes that only add or drop size-1 dimensions pass roles on; the softmax's
reduced dimension says which of L and R is the key axis.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_flex.fuse.graph import Const, Graph, Node, Value

ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt integer_pow
    is_finite le log log1p logistic lt max min mul ne neg nextafter not or pow
    reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh xor
""".split())
# Softmax plumbing between a reduction and its use: keepdims broadcasts, the
# stop_gradient and `max(-inf, .)` of jax.nn.softmax, casts.
PASS_THROUGH = frozenset(("broadcast_in_dim", "reshape", "stop_gradient",
                          "convert_element_type", "max", "squeeze"))
# A constant at or below this, selected where a predicate is false, is a mask.
MASK_LIMIT = -1e9


@dataclasses.dataclass
class Attention:
    """One fusable attention: its q.k and p.v products, the roles of every value computed
    from the scores, the masking predicates (value, negate) found on top of the logits,
    the logits under them (`score_value`), and the nodes the fused call replaces."""

    qk: Node
    pv: Node
    q_operand: int  # which operand of qk is q (the other is k)
    roles: dict  # Value -> tuple of roles ("q"/"kv" in place of L/R)
    logits: Value
    score_value: Value
    predicates: list  # (Value | Const, negate)
    probabilities: Value
    p_operand: int  # which operand of pv is the probabilities (the other is v)
    nodes: set
    masks_saturate: bool  # a mask constant was finite (-1e9 style), not -inf
    # The q.k product times a constant, the first op on it (`_leading_scale`): pf.attention's
    # scale. None and 1.0 where there is none.
    scaled: Value | None = None
    scale: float = 1.0
    # k and v read from under a `jnp.repeat` of their heads by this factor (set by
    # `rewrite.build`): the call takes them with native GQA. 1 where they are not.
    kv_repeat: int = 1
    # The product's output times sigmoid(gate) (`output_gate`), its only use: the call
    # then ends at that multiply.
    gate: "OutputGate | None" = None

    @property
    def has_score_mod(self) -> bool:
        return not any(self.score_value is x for x in (self.qk.outputs[0], self.scaled))


@dataclasses.dataclass
class Finding:
    """A softmax found: fused (with its `attention`) or not, and why not."""

    where: str
    attention: Attention | None
    reason: str | None


def find(graph: Graph) -> list[Finding]:
    producers, consumers = graph.producers(), graph.consumers()
    outputs = {x for x in graph.outputs if isinstance(x, Value)}
    findings = []
    for node in graph.nodes:
        if node.name != "exp":
            continue
        softmax = (_softmax_at(node, producers, consumers)
                   or _log_softmax_at(node, producers))
        if softmax is None:
            continue
        logits, axis, probabilities, softmax_nodes = softmax
        where = f"softmax over axis {axis} of a {list(logits.shape)} array"
        try:
            attention = _attention(graph, logits, axis, probabilities, softmax_nodes,
                                   producers, consumers, outputs)
            findings.append(Finding(where, attention, None))
        except _NotFusable as reason:
            findings.append(Finding(where, None, str(reason)))
    return findings


class _NotFusable(Exception):
    pass


def _single_axis(node):
    axes = tuple(node.params.get("axes", ()))
    return axes[0] if len(axes) == 1 else None


def _through(value, producers, names=PASS_THROUGH):
    """The value under any chain of pass-through ops (and the nodes passed), including
    logsumexp's guard `where(is_finite(m), m, 0)`."""
    passed = []
    while isinstance(value, Value) and value in producers and (
            producers[value].name in names or _finite_guard(producers[value], producers)):
        node = producers[value]
        if node.name == "select_n":
            is_finite = producers[node.inputs[0]]
            passed += [node, is_finite]
            value = node.inputs[2]
            continue
        if node.name == "max":  # jax.nn.softmax's max(-inf, m): keep the non-constant side
            side = [x for x in node.inputs if not isinstance(x, Const)]
            if len(side) != 1:
                break
            passed.append(node)
            value = side[0]
            continue
        passed.append(node)
        value = node.inputs[0]
    return value, passed


def _finite_guard(node, producers):
    """Whether `node` is `select_n(is_finite(m), 0, m)` (m where finite, else 0)."""
    if node.name != "select_n" or len(node.inputs) != 3:
        return False
    predicate, if_false, if_true = node.inputs
    test = producers.get(predicate) if isinstance(predicate, Value) else None
    return (test is not None and test.name == "is_finite" and test.inputs[0] is if_true
            and _constant(if_false, producers) == 0.0)


def _row_max_of(value, logits, axis, producers):
    """The nodes of `value` = max(logits) over `axis` (through pass-through ops), or None."""
    reduced, passed = _through(value, producers)
    reduce_max = producers.get(reduced)
    if reduce_max is None or reduce_max.name != "reduce_max" or \
            reduce_max.inputs[0] is not logits or _single_axis(reduce_max) != axis:
        return None
    return {reduce_max, *passed}


def _log_softmax_at(exp_node, producers):
    """(logits, axis, probabilities, nodes) if `exp` is exp(x - logsumexp(x)) over one
    axis, logsumexp as jax.nn.logsumexp writes it:
    log(|sum(exp(x - m))|) + m with m the guarded row max; else None."""
    sub = producers.get(exp_node.inputs[0])
    if sub is None or sub.name != "sub" or not isinstance(sub.inputs[0], Value):
        return None
    logits = sub.inputs[0]
    total, passed = _through(sub.inputs[1], producers, ("broadcast_in_dim", "reshape",
                                                         "stop_gradient"))
    add = producers.get(total)
    if add is None or add.name != "add":
        return None
    log_value, shift = add.inputs
    log = producers.get(log_value)
    if log is None or log.name != "log":
        return None
    summed, passed_sum = _through(log.inputs[0], producers, ("abs", "broadcast_in_dim",
                                                             "reshape"))
    reduce_sum = producers.get(summed)
    if reduce_sum is None or reduce_sum.name != "reduce_sum":
        return None
    axis = _single_axis(reduce_sum)
    inner_exp = producers.get(reduce_sum.inputs[0])
    inner_sub = producers.get(inner_exp.inputs[0]) if inner_exp is not None and \
        inner_exp.name == "exp" else None
    if inner_sub is None or inner_sub.name != "sub" or inner_sub.inputs[0] is not logits \
            or inner_sub.inputs[1] is not shift:
        return None
    max_nodes = _row_max_of(shift, logits, axis, producers)
    if max_nodes is None:
        return None
    nodes = {sub, add, log, reduce_sum, inner_exp, inner_sub, exp_node, *passed,
             *passed_sum, *max_nodes}
    return logits, axis, exp_node.outputs[0], nodes


def _softmax_at(exp_node, producers, consumers):
    """(logits, axis, probabilities, nodes) if `exp` is the middle of
    exp(x - max(x)) / sum(exp(x - max(x))) over one axis, else None. Also
    `jax.nn.softmax(x, where=mask)`: x masked to -inf under the max and the exp, the
    exponentials masked to 0 under the sum and the probabilities after the divide (a
    fully masked row gives zeros, as pallas_flex's do); its logits are then the -inf
    select under the exp, whose mask `_strip_masks` takes."""
    shifted = exp_node.inputs[0]
    sub = producers.get(shifted)
    if sub is None or sub.name != "sub":
        return None
    logits, row_max = sub.inputs
    if not isinstance(logits, Value):
        return None
    reduced, passed_max = _through(row_max, producers)
    reduce_max = producers.get(reduced)
    if reduce_max is None or reduce_max.name != "reduce_max":
        return None
    where = None  # jax.nn.softmax's `where`: (its mask, the select nodes)
    if reduce_max.inputs[0] is not logits:
        under_max = _where_filled(reduce_max.inputs[0], producers, -math.inf)
        under_exp = _where_filled(logits, producers, -math.inf)
        if (under_max is None or under_exp is None or under_max[1] is not under_exp[1]
                or not _same_value(under_max[0], under_exp[0], producers)):
            return None
        where = under_max[0], [under_max[2]]
    axis = _single_axis(reduce_max)
    exponentials = exp_node.outputs[0]
    users = consumers.get(exponentials, [])
    summed = exponentials
    if where is not None:  # the sum over exponentials zeroed where masked
        zeroed = next((n for n in users if _masks(n, where[0], exponentials, producers)),
                      None)
        if zeroed is None:
            return None
        where[1].append(zeroed)
        summed = zeroed.outputs[0]
    reduce_sum, widen = _row_sum_of(summed, consumers)
    divide = next((n for n in users if n.name == "div" and n.inputs[0] is exponentials),
                  None)
    if axis is None or reduce_sum is None or divide is None or \
            _single_axis(reduce_sum) != axis:
        return None
    total, passed_sum = _through(divide.inputs[1], producers)
    if total is not reduce_sum.outputs[0]:
        return None
    probabilities = divide.outputs[0]
    if where is not None:  # the probabilities zeroed where masked
        final = next((n for n in consumers.get(probabilities, [])
                      if _masks(n, where[0], probabilities, producers)), None)
        if final is None:
            return None
        where[1].append(final)
        probabilities = final.outputs[0]
    nodes = {sub, reduce_max, exp_node, reduce_sum, divide, *widen, *passed_max,
             *passed_sum, *(where[1] if where else ())}
    return logits, axis, probabilities, nodes


def _masks(node, mask, x, producers):
    """Whether `node` is jnp.where(mask, x, 0), its mask the same as `mask`."""
    found = _where_filled(node.outputs[0], producers, 0.0) if node.outputs else None
    return found is not None and found[1] is x and _same_value(found[0], mask, producers)


def _same_value(a, b, producers):
    """Whether a and b are one value broadcast the same way (each jnp.where broadcasts
    its mask anew)."""
    base_a, passed_a = _through(a, producers, ("broadcast_in_dim",))
    base_b, passed_b = _through(b, producers, ("broadcast_in_dim",))
    return base_a is base_b and [n.params for n in passed_a] == [n.params for n in passed_b]


def _where_filled(value, producers, fill):
    """(mask, x, node) if `value` is jnp.where(mask, x, fill) (a select_n of a constant
    `fill`, broadcast or cast), else None."""
    node = producers.get(value) if isinstance(value, Value) else None
    if node is None or node.name != "select_n" or len(node.inputs) != 3:
        return None
    mask, if_false, if_true = node.inputs
    if _constant(if_false, producers) != fill:
        return None
    return mask, if_true, node


def _row_sum_of(exponentials, consumers):
    """(the reduce_sum of `exponentials`, [the cast under it]) or (None, []): on 16-bit
    logits jax.nn.softmax sums in float32 (exp -> convert_element_type -> reduce_sum)."""
    for node in consumers.get(exponentials, []):
        if node.name == "reduce_sum":
            return node, []
        if node.name == "convert_element_type":
            widened = consumers.get(node.outputs[0], [])
            reduce_sum = next((n for n in widened if n.name == "reduce_sum"), None)
            if reduce_sum is not None:
                return reduce_sum, [node]
    return None, []


def free_dims(shape, contracting, batch):
    return [d for d in range(len(shape)) if d not in contracting and d not in batch]


def _product_roles(node):
    """Roles of a dot_general's output: batch dims, then the left operand's free dims,
    then the right's. One free dim of each operand longer than 1 is its sequence ("L" or
    "R"); a second one is a group of query heads sharing a KV head ("gL", "gR": GQA
    written as a reshape of q), the longer of the two taken as the sequence (either
    choice computes the same rows; this one keeps a mask's blocks on the sequence)."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = node.inputs
    roles = [("b", i) for i in range(len(lb))]
    for operand, contracting, batch, name in ((lhs, lc, lb, "L"), (rhs, rc, rb, "R")):
        free = free_dims(operand.shape, contracting, batch)
        long = [d for d in free if operand.shape[d] != 1]
        if len(long) not in (1, 2):
            return None
        sequence = max(long, key=lambda d: (operand.shape[d], d))
        roles += [None if operand.shape[d] == 1 else name if d == sequence else "g" + name
                  for d in free]
    return tuple(roles)


def _propagate(graph, start, roles):
    """Roles of every value computed from `start` through elementwise ops, transposes and
    size-1 reshapes; values reached another way are left out (`poisoned`)."""
    known = {start: roles}
    poisoned = set()
    for node in graph.nodes:
        dependent = [x for x in node.inputs if x in known or x in poisoned]
        if not dependent:
            continue
        out = node.outputs[0] if len(node.outputs) == 1 else None
        result = None
        if any(x in poisoned for x in dependent) or out is None:
            result = None
        elif node.name in ELEMENTWISE:
            result = _elementwise_roles(node, known, out)
        elif node.name == "transpose":
            source = known[node.inputs[0]]
            result = tuple(source[p] for p in node.params["permutation"])
        elif node.name in ("reshape", "squeeze"):
            result = reshape_roles(known[node.inputs[0]], node.inputs[0].shape, out.shape)
        if result is None:
            poisoned.update(node.outputs)
        else:
            known[out] = result
    return known, poisoned


def _elementwise_roles(node, known, out):
    result = [None if size == 1 else "?" for size in out.shape]
    for x in node.inputs:
        if x not in known:
            continue
        if len(x.shape) != len(out.shape):
            return None
        for d, (size, role) in enumerate(zip(x.shape, known[x])):
            if size == out.shape[d]:
                if result[d] not in ("?", None, role) and size != 1:
                    return None
                if size != 1:
                    result[d] = role
    if "?" in result:
        return None
    return tuple(result)


def reshape_roles(roles, in_shape, out_shape):
    """Roles through a reshape that only adds or drops size-1 dims, else None."""
    long_in = [(s, r) for s, r in zip(in_shape, roles) if s != 1]
    long_out = [s for s in out_shape if s != 1]
    if [s for s, _ in long_in] != long_out:
        return None
    it = iter(r for _, r in long_in)
    return tuple(next(it) if s != 1 else None for s in out_shape)


def _constant(x, producers):
    """The value of a constant built from a scalar literal (broadcasts, casts), or None."""
    x, _ = _through(x, producers, ("broadcast_in_dim", "convert_element_type", "reshape"))
    if isinstance(x, Const) and math.prod(x.shape) == 1:
        return float(x.value if not x.shape else x.value.reshape(()))
    return None


def _attention(graph, logits, axis, probabilities, softmax_nodes, producers, consumers,
               outputs):
    users = [n for n in consumers.get(probabilities, [])]
    cast = None
    if len(users) == 1 and users[0].name == "convert_element_type":
        cast = users[0]
        users = consumers.get(cast.outputs[0], [])
    pv = users[0] if len(users) == 1 and users[0].name == "dot_general" else None
    if pv is None:
        raise _NotFusable("the probabilities are not used by exactly one product with "
                          "the values (" + ", ".join(sorted({n.name for n in users})) + ")")
    fed = cast.outputs[0] if cast else probabilities
    p_operand = 0 if pv.inputs[0] is fed else 1
    candidates = []
    for qk in graph.nodes:
        if qk.name != "dot_general" or qk is pv:
            continue
        roles = _product_roles(qk)
        if roles is None:
            continue
        known, _ = _propagate(graph, qk.outputs[0], roles)
        if logits in known:
            candidates.append((qk, known))
    if not candidates:
        raise _NotFusable("the logits are not computed from one q.k product by "
                          "elementwise ops (each sequence dimension one axis)")
    qk, known = candidates[-1]
    logit_roles = known[logits]
    if logit_roles[axis] not in ("L", "R"):
        raise _NotFusable("the softmax does not run over the key axis of the q.k product")
    key_side = logit_roles[axis]
    if "g" + key_side in logit_roles:
        raise _NotFusable("the keys have two free dimensions")
    query_side = "R" if key_side == "L" else "L"
    rename = {key_side: "kv", query_side: "q", "g" + query_side: ("g", 0)}
    roles = {v: tuple(rename.get(r, r) for r in rs) for v, rs in known.items()}
    roles[probabilities] = roles[logits]
    if cast is not None:
        roles[cast.outputs[0]] = roles[logits]

    # Everything computed from the scores must feed only this p.v product.
    nodes = {qk, pv, *softmax_nodes} | ({cast} if cast else set())
    region = _downstream(qk.outputs[0], consumers, stop=pv)
    upstream = _upstream(pv, producers)
    for node in region:
        if node is pv:
            continue
        if any(x in outputs for x in node.outputs):
            raise _NotFusable(f"an intermediate ({node.name}) is also an output")
        dead = not any(consumers.get(x) for x in node.outputs)  # (logsumexp's sign)
        if node not in upstream and not dead:
            raise _NotFusable(f"the scores also feed {node.name} outside the softmax")
        nodes.add(node)

    _check_pv(pv, p_operand, roles[logits])
    score_value, predicates, saturating = _strip_masks(logits, roles, producers)
    scaled, scale = _leading_scale(qk.outputs[0], nodes)
    score_value = _scores_under_layout(score_value, (qk.outputs[0], scaled), producers)
    return Attention(qk=qk, pv=pv, q_operand=0 if key_side == "R" else 1, roles=roles,
                     logits=logits, score_value=score_value, predicates=predicates,
                     probabilities=fed, p_operand=p_operand, nodes=nodes,
                     masks_saturate=saturating, scaled=scaled, scale=scale)


def _scores_under_layout(value, scores, producers):
    """The one of `scores` (the q.k product, its scaled value) that `value` is, through
    ops that only move or cast to float32 its elements (transposes, reshapes, squeezes,
    broadcasts: jax.nn.dot_product_attention's logits transposed to [B, N, T, S] before
    its mask); `value` itself where it is not one of them. A score_mod that would only
    hand the score back is no score_mod: the kernels' calls without one are faster
    (`_leading_scale`)."""
    start = value
    while isinstance(value, Value) and not any(value is x for x in scores):
        node = producers.get(value)
        if node is None or node.name not in _LAYOUT or (
                node.name == "convert_element_type"
                and jnp.dtype(node.outputs[0].dtype) != jnp.float32):
            return start
        value = node.inputs[0]
    return value if isinstance(value, Value) else start


_LAYOUT = ("transpose", "reshape", "squeeze", "broadcast_in_dim", "convert_element_type")


def _leading_scale(scores, nodes):
    """(the scaled scores, the factor) where the first operation on the q.k product
    (through a cast to float32) multiplies it by a positive constant (or divides by one),
    else (None, 1.0). The factor becomes pf.attention's `scale`, so that plain `s * scale`
    code makes the call a user writes, with no score_mod: as a score_mod the same
    multiplication cost the H100 10-17 % of the hand-written call's forward+backward
    (benchmarks/results/h100/fuse.json before this), through the kernels' choices for
    calls with a mod (the Mosaic forward's hand-over, the backward's dS times the mod's
    derivative). Other uses of the unscaled scores still see them (`rewrite._Mods._scalar`
    divides the kernel's scaled score back). nodes: the fused region's.."""
    sources = {id(scores)} | {
        id(node.outputs[0]) for node in nodes
        if node.name == "convert_element_type" and node.inputs[0] is scores
        and jnp.dtype(node.outputs[0].dtype) == jnp.float32}
    found = []
    for node in nodes:
        if node.name not in ("mul", "div") or len(node.inputs) != 2:
            continue
        for position, (operand, other) in enumerate((node.inputs, node.inputs[::-1])):
            if node.name == "div" and position == 1:
                continue  # c / s is no scaling
            if (id(operand) in sources and isinstance(other, Const) and not other.shape
                    and jnp.dtype(node.outputs[0].dtype) == jnp.float32):
                factor = float(other.value)
                factor = 1.0 / factor if node.name == "div" and factor else factor
                if math.isfinite(factor) and factor > 0:
                    found.append((node.outputs[0], factor))
    return found[0] if len(found) == 1 else (None, 1.0)



def _downstream(start, consumers, stop):
    seen, todo = set(), [start]
    while todo:
        value = todo.pop()
        for node in consumers.get(value, []):
            if node in seen:
                continue
            seen.add(node)
            if node is not stop:
                todo.extend(node.outputs)
    return seen


def _upstream(node, producers):
    seen, todo = set(), [node]
    while todo:
        for x in todo.pop().inputs:
            producer = producers.get(x) if isinstance(x, Value) else None
            if producer is not None and producer not in seen:
                seen.add(producer)
                todo.append(producer)
    return seen


def _check_pv(pv, p_operand, p_roles):
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    contracting, batch = (lc, lb) if p_operand == 0 else (rc, rb)
    v = pv.inputs[1 - p_operand]
    v_contracting, v_batch = (rc, rb) if p_operand == 0 else (lc, lb)
    if len(contracting) != 1 or p_roles[contracting[0]] != "kv":
        raise _NotFusable("the product with the values does not contract the key axis")
    # Size-1 dims are left out: their roles are not kept (elementwise ops, reshapes),
    # and any layout of them is the same array (a batch of one, as benchmarks run).
    p_shape = pv.inputs[p_operand].shape
    long_batch = [d for d in batch if p_shape[d] != 1]
    batch_roles = {r for r, size in zip(p_roles, p_shape)
                   if isinstance(r, tuple) and r[0] == "b" and size != 1}
    if {p_roles[d] for d in long_batch} != batch_roles or \
            len(long_batch) != len(batch_roles):
        raise _NotFusable("the product with the values does not keep every batch/head "
                          "dimension of the scores")
    long_free = [d for d in free_dims(v.shape, v_contracting, v_batch) if v.shape[d] != 1]
    if len(long_free) != 1:
        raise _NotFusable("the values have more than one feature dimension")


def _strip_masks(logits, roles, producers):
    """(the logits under `where(mask, ., very negative)` selects, [(predicate, negate)],
    whether a mask constant was finite)."""
    predicates, saturating = [], False
    value = logits
    while value in producers and producers[value].name in ("select_n", "convert_element_type"):
        if producers[value].name == "convert_element_type":  # -inf stays -inf
            if producers[value].inputs[0] not in roles:
                break
            value = producers[value].inputs[0]
            continue
        if len(producers[value].inputs) != 3:
            break
        predicate, if_false, if_true = producers[value].inputs
        if predicate in roles:  # the predicate depends on the scores: not a mask
            break
        false_constant = _constant(if_false, producers)
        true_constant = _constant(if_true, producers)
        if false_constant is not None and false_constant <= MASK_LIMIT and if_true in roles:
            predicates.append((predicate, False))
            saturating |= false_constant != -math.inf
            value = if_true
        elif true_constant is not None and true_constant <= MASK_LIMIT and if_false in roles:
            predicates.append((predicate, True))
            saturating |= true_constant != -math.inf
            value = if_false
        else:
            break
    return value, predicates, saturating


@dataclasses.dataclass
class OutputGate:
    """A multiply by sigmoid(gate) after an attention's p.v product (`output_gate`)."""

    multiply: Node
    gate: Value | Const
    layout: list  # the casts, transposes, reshapes between the product and the multiply
    sigmoid: Node | None  # the sigmoid, where only the multiply reads it (else None)


def output_gate(attention, graph, producers, consumers):
    """The `OutputGate` if the p.v product's only use is a multiply by `sigmoid(gate)` of
    the same shape, through casts, transposes and reshapes (an einsum's output
    transpose; AlphaFold's `weighted_avg * jax.nn.sigmoid(gate)`): the fused call then
    takes the gate in its forward kernel's epilogue (`pf.attention`'s output_gate).
    Else None. producers, consumers: the graph's (`Graph.producers`, `.consumers`)."""
    outputs = {x for x in graph.outputs if isinstance(x, Value)}
    value, layout = attention.pv.outputs[0], []
    while True:
        users = consumers.get(value, [])
        if value in outputs or len(users) != 1:
            return None
        node = users[0]
        if node.name not in _GATE_PASSES or node.inputs[0] is not value:
            break
        layout.append(node)
        value = node.outputs[0]
    if node.name != "mul" or len(node.inputs) != 2:
        return None
    other = node.inputs[1 - node.inputs.index(value)]
    sigmoid = producers.get(other) if isinstance(other, Value) else None
    if (sigmoid is None or sigmoid.name != "logistic"
            or tuple(other.shape) != tuple(value.shape)
            or tuple(node.outputs[0].shape) != tuple(value.shape)):
        return None
    return OutputGate(node, sigmoid.inputs[0], layout,
                      sigmoid if consumers.get(other) == [node] else None)


# Layout ops between a product and its gate's multiply (`output_gate`).
_GATE_PASSES = ("convert_element_type", "transpose", "reshape")
