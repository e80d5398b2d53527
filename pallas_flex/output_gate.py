"""Output gates: attention's output multiplied elementwise by sigmoid(gate), a gate per
query, head and value column (AlphaFold's gated self-attention; the gated attention of
Qwen3-Next and "Gated Attention for Large Language Models", whose gate is a projection
of the layer's input).

    out = sigmoid(gate) * softmax(scores) v

Fused where it pays: a gated call that no one differentiates (inference) runs the Triton
or Mosaic GPU forward with the gate read in its epilogue (`kernels/forward.py`;
`kernels/forward_mosaic.py` copies each warpgroup's gate tile into its output staging
buffer, under the walk in a persistent program), so the ungated output never reaches
HBM: the multiply outside the kernel would read that output and the gate and write the
result, three passes over an array of the output's size. Every other kernel, and the
forward of a differentiated call, applies it after the kernel (`gated`), in float32: the
backward needs the ungated output anyway (its delta is rowsum(dO * out) of the softmax's
own output), and from it

    d_out = d_y * sigmoid(gate),   d_gate = d_y * out * sigmoid(gate) * (1 - sigmoid(gate))

(`gate_gradients`), one XLA fusion beside the backward kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_output_gate(gate, q, v):
    """`gate` as given, if it is None or a float array [B, Sq, Hq, Dv] (q's batch, length
    and heads, v's value dim); else a ValueError."""
    if gate is None:
        return None
    shape = tuple(q.shape[:3]) + (v.shape[3],)
    if not hasattr(gate, "shape") or tuple(gate.shape) != shape:
        raise ValueError(f"output_gate must have the output's shape {shape} [B, Sq, Hq, Dv], "
                         f"got {getattr(gate, 'shape', type(gate).__name__)}")
    if not jnp.issubdtype(gate.dtype, jnp.floating):
        raise ValueError(f"output_gate must be a float array, got {gate.dtype}")
    return gate


def gated(out, gate):
    """out * sigmoid(gate) in float32, in out's dtype (gate None: out)."""
    if gate is None:
        return out
    return (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(
        out.dtype)


def gated_result(result, gate):
    """A call's result (out, or a tuple starting with it) with out gated (`gated`): for
    the entry points whose path runs no forward kernel of `pallas_flex.api`'s."""
    if gate is None or not isinstance(result, tuple):
        return gated(result, gate)
    return (gated(result[0], gate), *result[1:])


def gate_gradients(out, gate, d_y, gate_wanted: bool):
    """(d_out in d_y's dtype, d_gate in gate's: zeros where not `gate_wanted`) of
    y = out * sigmoid(gate) given the ungated output `out` and y's cotangent d_y."""
    sigmoid = jax.nn.sigmoid(gate.astype(jnp.float32))
    d_y32 = d_y.astype(jnp.float32)
    d_out = (d_y32 * sigmoid).astype(d_y.dtype)
    if not gate_wanted:
        return d_out, jnp.zeros_like(gate)
    d_gate = d_y32 * out.astype(jnp.float32) * sigmoid * (1.0 - sigmoid)
    return d_out, d_gate.astype(gate.dtype)
