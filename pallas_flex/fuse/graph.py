"""A flat view of a jaxpr for `pf.fuse`: nested `jit`s inlined (`jnp.where` and
`jnp.tril` are jits of their own, so an attention's ops are spread over several levels),
every value an identity-compared `Value`, every literal a `Const`; and the evaluator
that runs it eqn by eqn, replacing the matched attention subgraphs by kernel calls."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.extend import core as jax_core

INLINED = ("jit", "pjit", "closed_call", "core_call")


@dataclasses.dataclass(eq=False)
class Value:
    shape: tuple
    dtype: Any

    def __repr__(self):
        return f"Value{self.shape}:{self.dtype}"


@dataclasses.dataclass(eq=False)
class Const:
    value: Any

    @property
    def shape(self):
        return tuple(jax.numpy.shape(self.value))

    @property
    def dtype(self):
        return jax.numpy.result_type(self.value)


@dataclasses.dataclass(eq=False)
class Node:
    primitive: Any
    params: dict
    inputs: list  # Value | Const
    outputs: list  # Value

    @property
    def name(self):
        return self.primitive.name


@dataclasses.dataclass
class Graph:
    inputs: list  # Value per jaxpr input
    consts: list  # (Value, array) for the closed jaxpr's constants
    nodes: list
    outputs: list  # Value | Const

    def producers(self):
        return {value: node for node in self.nodes for value in node.outputs}

    def consumers(self):
        users = {}
        for node in self.nodes:
            for x in node.inputs:
                if isinstance(x, Value):
                    users.setdefault(x, []).append(node)
        return users


def flatten(closed: jax_core.ClosedJaxpr) -> Graph:
    """The jaxpr with its nested jits inlined."""
    graph = Graph([], [], [], [])
    env = {}
    for var in closed.jaxpr.invars:
        env[var] = Value(tuple(var.aval.shape), var.aval.dtype)
        graph.inputs.append(env[var])
    for var, const in zip(closed.jaxpr.constvars, closed.consts):
        env[var] = Value(tuple(var.aval.shape), var.aval.dtype)
        graph.consts.append((env[var], const))
    _inline(closed.jaxpr, env, graph.nodes)
    graph.outputs = [_read(env, var) for var in closed.jaxpr.outvars]
    return graph


def _read(env, var):
    if isinstance(var, jax_core.Literal):
        return Const(var.val)
    return env[var]


def _inline(jaxpr, env, nodes):
    for eqn in jaxpr.eqns:
        inputs = [_read(env, var) for var in eqn.invars]
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if eqn.primitive.name in INLINED and inner is not None:
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            inner_consts = getattr(inner, "consts", ())
            inner_env = dict(zip(inner_jaxpr.invars, inputs))
            inner_env.update((var, Const(c)) for var, c in
                             zip(inner_jaxpr.constvars, inner_consts))
            _inline(inner_jaxpr, inner_env, nodes)
            for outer, inner_out in zip(eqn.outvars, inner_jaxpr.outvars):
                env[outer] = _read(inner_env, inner_out)
            continue
        outputs = [Value(tuple(var.aval.shape), var.aval.dtype) for var in eqn.outvars]
        for var, value in zip(eqn.outvars, outputs):
            env[var] = value
        nodes.append(Node(eqn.primitive, dict(eqn.params), inputs, outputs))


def bind(node, arguments):
    """The node's primitive applied to `arguments` (what `jax.core.eval_jaxpr` does)."""
    params = node.primitive.get_bind_params(node.params)
    results = node.primitive.bind(*arguments, **params)
    return list(results) if node.primitive.multiple_results else [results]


def evaluate(graph: Graph, arguments, replacements):
    """The graph's outputs on `arguments`; `replacements` maps a node to a function of
    the environment giving its outputs (a fused attention in place of its P·V product),
    and lists the nodes to skip (the rest of each fused subgraph)."""
    env = dict(zip(graph.inputs, arguments))
    env.update(graph.consts)
    skipped = replacements.skipped
    for node in graph.nodes:
        if node in replacements.calls:
            results = replacements.calls[node](lambda x: read(env, x))
        elif node in skipped:
            continue
        else:
            results = bind(node, [read(env, x) for x in node.inputs])
        for value, result in zip(node.outputs, results):
            env[value] = result
    return [read(env, x) for x in graph.outputs]


def read(env, x):
    return x.value if isinstance(x, Const) else env[x]
