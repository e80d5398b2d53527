"""`pf.fuse`: attention written as plain JAX code, run on pallas_flex's kernels.

`pf.fuse(fn)` traces `fn` to a jaxpr (nested jits inlined), finds each
`dot_general(q, k) -> elementwise ops -> softmax -> dot_general(., v)` and runs it as one
`pf.attention` call: `where(mask, s, very negative)` selects on top of the logits (and
`jax.nn.softmax`'s `where=`) become the mask_mod (so its BlockMask skips empty blocks;
positions the code builds with np.arange are index arithmetic), the other elementwise ops the
score_mod, evaluated at scalar (b, h, q_idx, kv_idx) by the graph's own primitives;
arrays they read (a bias tensor, ALiBi slopes, lengths) become captured arrays, with
their gradients; a multiply of the output by `sigmoid(gate)` becomes the call's
output_gate. Everything else runs as written. `pf.explain_fuse(fn, *args)` says, per
softmax found, what was fused and, if not, why.

Semantics kept: outputs and gradients of the written code, up to rounding (the kernels
compute the scores in float32). One difference: a row whose every key is masked gives
zeros (pallas_flex's rule); the written code gives NaN with `-inf` and a uniform average
with a finite mask constant (`jnp.finfo(dtype).min`, `-1e9`), zeros with
`jax.nn.softmax(..., where=mask)`.
"""

from __future__ import annotations

import functools

import jax
import jax.extend

from pallas_flex.fuse import graph as graph_lib
from pallas_flex.fuse import match, rewrite

__all__ = ["fuse", "explain_fuse"]


class _Replacements:
    def __init__(self):
        self.calls, self.skipped = {}, set()


def _trace(fn, args, kwargs):
    """(graph, array leaves, output tree): `fn` traced on the arrays among `args`
    (the other leaves, and kwargs, are static)."""
    leaves, tree = jax.tree.flatten(args)
    is_array = [hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves]
    arrays = [x for x, a in zip(leaves, is_array) if a]

    def traced(*array_leaves):
        it = iter(array_leaves)
        full = [next(it) if a else x for x, a in zip(leaves, is_array)]
        return fn(*jax.tree.unflatten(tree, full), **kwargs)
    closed, shape = jax.make_jaxpr(traced, return_shape=True)(
        *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays])
    return graph_lib.flatten(closed), arrays, jax.tree.structure(shape)


REMAT = ("remat2", "checkpoint")


def _closed(jaxpr):
    """A region's jaxpr (open, its constants on it, or closed) as a ClosedJaxpr; None
    when its constants can't be had."""
    if isinstance(jaxpr, jax.extend.core.ClosedJaxpr):
        return jaxpr
    consts = list(getattr(jaxpr, "consts", None) or ())
    if len(consts) != len(jaxpr.constvars):
        return None
    return jax.extend.core.ClosedJaxpr(jaxpr, consts)


def _regions(node):
    """(where, run, {name: graph}) for a node whose body `_plan` looks inside: a
    `jax.checkpoint` region, a `lax.scan` body (also `fori_loop` with static bounds) or
    a `lax.while_loop` body; None for other nodes."""
    if node.name in REMAT:
        where, run, names = "inside jax.checkpoint: ", _remat, ("jaxpr",)
    elif node.name == "scan":
        where, run, names = "inside lax.scan: ", _scan, ("jaxpr",)
    elif node.name == "while":
        where, run, names = "inside lax.while_loop: ", _while, ("body_jaxpr", "cond_jaxpr")
    else:
        return None
    closed = [_closed(node.params[name]) if name in node.params else None
              for name in names]
    if any(c is None for c in closed):
        return None
    return where, run, {name: graph_lib.flatten(c) for name, c in zip(names, closed)}


def _plan(graph, options, where=""):
    """(findings, replacements) of a graph, recursing into `jax.checkpoint` regions (a
    remat'd transformer block keeps its rematerialization, with its attention fused) and
    `lax.scan` / `lax.while_loop` bodies (layers scanned over stacked parameters): each
    body is planned on its own and the loop run on the fused body."""
    findings = match.find(graph)
    for finding in findings:
        finding.where = where + finding.where
    replacements = _Replacements()
    for node in graph.nodes:
        region = _regions(node)
        if region is None:
            continue
        inner_where, run, graphs = region
        body = graphs.get("jaxpr", graphs.get("body_jaxpr"))
        inner_findings, inner_replacements = _plan(body, options, where + inner_where)
        findings += inner_findings
        if inner_replacements.calls:
            replacements.calls[node] = functools.partial(
                run, node=node, graphs=graphs, replacements=inner_replacements)
    producers, consumers = graph.producers(), graph.consumers()
    for finding in findings:
        attention = finding.attention
        if attention is None:
            continue
        # A multiply by sigmoid(gate) after the product joins the call: it then
        # replaces the multiply, and the product and any cast between are skipped.
        attention.gate = match.output_gate(attention, graph, producers, consumers)
        gate = attention.gate
        last = attention.pv if gate is None else gate.multiply
        replacements.calls[last] = functools.partial(
            _fused, attention=attention, options=options, producers=producers,
            finding=finding)
        replacements.skipped |= attention.nodes - {last}
        if gate is not None:
            replacements.skipped |= {attention.pv, *gate.layout} | (
                {gate.sigmoid} if gate.sigmoid is not None else set())
    return findings, replacements


def _remat(read, *, node, graphs, replacements):
    """A `jax.checkpoint` region run with its attention fused, rematerialized as before."""
    def region(*arguments):
        return graph_lib.evaluate(graphs["jaxpr"], list(arguments), replacements)
    return jax.checkpoint(region, prevent_cse=node.params.get("prevent_cse", True),
                          policy=node.params.get("policy"))(*[read(x) for x in node.inputs])


def _scan(read, *, node, graphs, replacements):
    """A `lax.scan` run on its body with the attention fused: same length, direction and
    unrolling, the same consts, carries and xs; scan's own AD differentiates it (the
    fused calls through their custom VJP)."""
    params = node.params
    arguments = [read(x) for x in node.inputs]
    if "ft_in" in params:  # consts, carries, xs as flat trees
        consts, init, xs = (list(part) for part in
                            params["ft_in"].update(arguments).unpack())
    else:
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        consts, init, xs = (arguments[:n_consts], arguments[n_consts:n_consts + n_carry],
                            arguments[n_consts + n_carry:])

    def body(carry, x):
        out = graph_lib.evaluate(graphs["jaxpr"], [*consts, *carry, *x], replacements)
        return out[:len(init)], out[len(init):]
    carry, ys = jax.lax.scan(body, init, xs, length=params["length"],
                             reverse=params["reverse"], unroll=params.get("unroll", 1))
    return [*carry, *ys]


def _while(read, *, node, graphs, replacements):
    """A `lax.while_loop` run on its body with the attention fused (its cond as written)."""
    params = node.params
    arguments = [read(x) for x in node.inputs]
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts = arguments[:n_cond]
    body_consts = arguments[n_cond:n_cond + n_body]

    def cond(carry):
        return graph_lib.evaluate(graphs["cond_jaxpr"], [*cond_consts, *carry],
                                  _Replacements())[0]

    def body(carry):
        return graph_lib.evaluate(graphs["body_jaxpr"], [*body_consts, *carry],
                                  replacements)
    return list(jax.lax.while_loop(cond, body, arguments[n_cond + n_body:]))


def _fused(read, *, attention, options, producers, finding):
    try:
        return rewrite.build(attention, read, options, producers)
    except rewrite.Unsupported as reason:
        finding.attention, finding.reason = None, str(reason)
        raise


def fuse(fn=None, *, explain=False, backend=None, kernel_options=None):
    """`fn` with its attention subgraphs run by pallas_flex's kernels.

    Args:
      fn: a function of arrays (pytrees allowed; non-array leaves and keyword arguments
        are static). Usable under and around `jax.jit`, `jax.grad`, `jax.vmap`.
      explain: print, each time `fn` is traced, what was fused (`explain_fuse`'s text).
      backend, kernel_options: as in `pf.attention`, for every fused call.
    Returns:
      a function with `fn`'s signature and results.

    Example:
      >>> def attend(q, k, v):                      # [B, S, H, D]
      ...     s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
      ...     s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
      ...     return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
      >>> out = jax.jit(pf.fuse(attend))(q, k, v)  # one causal pf.attention call
    """
    if fn is None:
        return functools.partial(fuse, explain=explain, backend=backend,
                                 kernel_options=kernel_options)
    options = {"backend": backend, "kernel_options": kernel_options}

    @functools.wraps(fn)
    def fused(*args, **kwargs):
        graph, arrays, out_tree = _trace(fn, args, kwargs)
        findings, replacements = _plan(graph, options)
        try:
            results = graph_lib.evaluate(graph, arrays, replacements)
        except rewrite.Unsupported:  # found late (while building a call): run unfused
            results = graph_lib.evaluate(graph, arrays, _Replacements())
        if explain:
            print(_describe(findings))
        return jax.tree.unflatten(out_tree, results)
    return fused


def explain_fuse(fn, *args, **kwargs) -> str:
    """What `pf.fuse(fn)(*args, **kwargs)` fuses: one line per softmax found."""
    graph, arrays, _ = _trace(fn, args, kwargs)
    findings, replacements = _plan(graph, {"backend": "xla", "kernel_options": None})
    try:
        jax.eval_shape(lambda *a: graph_lib.evaluate(graph, list(a), replacements),
                       *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays])
    except rewrite.Unsupported:
        pass
    return _describe(findings)


def _describe(findings):
    if not findings:
        return "no softmax found"
    lines = []
    for finding in findings:
        attention = finding.attention
        if attention is None:
            lines.append(f"{finding.where}: not fused: {finding.reason}")
            continue
        parts = [f"mask_mod from {len(attention.predicates)} predicate(s)"
                 if attention.predicates else "no mask",
                 "score_mod" if attention.has_score_mod else "no score_mod"]
        if attention.scale != 1.0:
            parts.append(f"scale {attention.scale:.6g}")
        if attention.kv_repeat > 1:
            parts.append(f"k, v read before their {attention.kv_repeat}-fold jnp.repeat "
                         "of heads (native GQA)")
        if attention.gate is not None:
            parts.append("output gate sigmoid(g) in the kernel's epilogue")
        if attention.masks_saturate:
            parts.append("finite mask constant: fully masked rows give zeros, not a "
                         "uniform average")
        lines.append(f"{finding.where}: fused into pf.attention ({'; '.join(parts)})")
    return "\n".join(lines)
