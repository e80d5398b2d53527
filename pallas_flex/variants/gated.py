"""AlphaFold's Evoformer gated self-attention (MSA row attention with pair bias).

Every row of the multiple sequence alignment attends over the residues with the same
pair bias (from the pair representation, [B, H, S, S]), its own key bias (the padding
mask as -inf, or any float bias, [B, R, S]), and the output is gated by a sigmoid
(`pf.attention`'s output_gate). Rows fold into the batch axis; the biases are score_mod
reads of captured arrays (the pair bias a block a tile in the Triton kernels), so both
get gradients, and a key mask given as booleans becomes a mask_mod whose BlockMask
skips fully masked blocks.
Column attention is the same call on the transposed MSA.
"""

from __future__ import annotations

from pallas_flex.api import attention


def gated_self_attention(q, k, v, gate, *, pair_bias, key_bias=None, key_mask=None,
                         scale=None, backend=None, kernel_options=None):
    """sigmoid(gate) * softmax(q k^T * scale + pair_bias + key_bias, masked) v, per row.

    Args:
      q, k, v: [B, R, S, H, D] (R MSA rows of S residues; keys and values from the same
        row: self-attention along the row).
      gate: [B, R, S, H, Dv] pre-activation; the output is multiplied by sigmoid(gate).
      pair_bias: float [B, H, S, S], shared by every row of a batch element
        (differentiable).
      key_bias: None or float [B, R, S], added to every query's score for that key
        (differentiable).
      key_mask: None or bool [B, R, S], False = padding: those keys are masked out (a
        row with no key gives zeros).
      scale, backend, kernel_options: as in `pf.attention`.
    Returns:
      [B, R, S, H, Dv] in q's dtype.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("gate", gate)):
        if x.ndim != 5:
            raise ValueError(f"{name} must be [B, R, S, H, D], got shape {x.shape}")
    batch, rows, residues, heads, _ = q.shape
    if k.shape[:3] != (batch, rows, residues) or v.shape[:3] != (batch, rows, residues):
        raise ValueError(f"k and v must share q's [B, R, S] = {(batch, rows, residues)}, "
                         f"got {k.shape} and {v.shape}")
    if gate.shape != q.shape[:4] + v.shape[4:]:
        raise ValueError(f"gate must have shape {q.shape[:4] + v.shape[4:]}, got {gate.shape}")
    if pair_bias.shape != (batch, heads, residues, residues):
        raise ValueError(f"pair_bias must have shape {(batch, heads, residues, residues)} "
                         f"[B, H, S, S], got {pair_bias.shape}")
    for name, x in (("key_bias", key_bias), ("key_mask", key_mask)):
        if x is not None and x.shape != (batch, rows, residues):
            raise ValueError(f"{name} must have shape {(batch, rows, residues)} [B, R, S], "
                             f"got {x.shape}")

    folded = folded_call(q, k, v, gate, pair_bias=pair_bias, key_bias=key_bias,
                         key_mask=key_mask)
    # The gate joins the forward kernel's epilogue where no one differentiates the call
    # (`pallas_flex/output_gate.py`).
    out = attention(**folded, scale=scale, backend=backend, kernel_options=kernel_options)
    return out.reshape(gate.shape)


def folded_call(q, k, v, gate, *, pair_bias, key_bias=None, key_mask=None) -> dict:
    """The `pf.attention` arguments of `gated_self_attention` (checked there): the rows
    folded into the batch axis, the biases a score_mod (the pair bias read at b // R),
    the key mask a mask_mod, the gate the output gate. `pallas_flex.bench.ab` explains
    the call from them."""
    batch, rows, residues = q.shape[:3]

    def fold(x):  # rows into the batch axis: [B * R, S, H, D]
        return x.reshape((batch * rows,) + x.shape[2:])

    key_bias_rows = None if key_bias is None else key_bias.reshape(batch * rows, residues)

    def biases(score, b, h, q_idx, kv_idx):
        score = score + pair_bias[b // rows, h, q_idx, kv_idx]
        if key_bias_rows is not None:
            score = score + key_bias_rows[b, kv_idx]
        return score

    mask_mod = None
    if key_mask is not None:
        mask_rows = key_mask.reshape(batch * rows, residues)

        def mask_mod(b, h, q_idx, kv_idx):
            return mask_rows[b, kv_idx]

    return dict(q=fold(q), k=fold(k), v=fold(v), mask_mod=mask_mod, score_mod=biases,
                output_gate=fold(gate))
