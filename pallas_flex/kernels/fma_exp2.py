"""exp2 on the FMA units for a share of a tile's registers (Mosaic GPU kernels).

A softmax tile's exponentials run on the transcendental unit (MUFU: `ex2.approx.ftz.f32`,
16 a clock per SM on Hopper, against 128 FMAs). At head dim 64 the forward spends as many
clocks on a tile's exponentials as on its two matmuls, and a soft-cap's `tanh` doubles
the transcendental work, so the unit, not the tensor cores, sets the pace. As
FlashAttention-4 does on Blackwell, part of the exponentials can be computed on the FMA
units instead, from a polynomial:

    x = max(x, -127)                       (-inf and x <= -127 to -127)
    t = x + 1.5 * 2**23                    (round to nearest: n sits in t's low bits)
    f = x - (t - 1.5 * 2**23)              (f in [-0.5, 0.5])
    p = ((c3 f + c2) f + c1) f + 1         (2**f, minimax relative error 1.0e-4 with p(0)
                                            exactly 1)
    exp2(x) = bits(p) + (bits(t) << 23)    (n added to p's exponent)

At x = -127, f = 0 and p = 1 exactly, so the sum of bits is +0: exp2(-inf) is exactly 0
(a fully masked row's sum stays 0), and x in (-127, -126.5) gives a denormal, never a
wrapped exponent. Nine FMA-pipe instructions replace one MUFU instruction, whose unit
issues at an eighth of the FMAs' rate, so moving a share of the registers can balance the
two (`exp2`'s `share`); where it pays is measured, not assumed
(`mosaic_eligibility.exp2_fma_share`). The relative error, 1.0e-4, is below a 16-bit
probability's rounding (2**-9 for bfloat16, 2**-11 for float16), which is what the kernels
multiply V by; the row sums are float32 sums of these values.

`exp2_reference` is the same arithmetic in jnp (the accuracy test, and interpret mode's
stand-in for the register code, which has no interpret rule).
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp
from jax import lax

# 2**f on [-0.5, 0.5] with p(0) = 1: minimax for the relative error (linear programming on
# 20001 points), 1.013e-4 in float64 and evaluated in float32 as below.
COEFFICIENTS = (1.0, 0.6932829022407532, 0.24221095442771912, 0.05500892922282219)
ROUNDING = 12582912.0  # 1.5 * 2**23: x + it rounds x to an integer held in the low bits
LOWEST = -127.0


def exp2_reference(x):
    """The polynomial exp2 in jnp (float32 in, float32 out), as the kernels compute it. The
    rounding is `jnp.round` here: XLA's CPU compiler folds (x + 1.5 * 2**23) - 1.5 * 2**23
    back into x (the register code's MLIR carries no fast-math flags, and rounds)."""
    x = jnp.maximum(x.astype(jnp.float32), LOWEST)
    n = jnp.round(x)
    f = x - n
    c0, c1, c2, c3 = (np.float32(c) for c in COEFFICIENTS)
    p = (((c3 * f + c2) * f + c1) * f) + c0
    bits = (lax.bitcast_convert_type(p, jnp.int32)
            + lax.shift_left(n.astype(jnp.int32), jnp.int32(23)))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _on_registers(x, share: tuple[int, int]):
    """exp2 of a float32 FragmentedArray: registers i with i % share[1] < share[0] by the
    polynomial, the others by `ex2.approx.ftz.f32`."""
    import jax.experimental.mosaic.gpu as mgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, math as mlir_math

    on_fma, period = share
    f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)

    def splat(value, like_type, element):
        attribute = (ir.FloatAttr.get(element, value) if element == f32
                     else ir.IntegerAttr.get(element, value))
        if isinstance(like_type, ir.VectorType):
            shape = ir.VectorType(like_type).shape
            return arith.constant(ir.VectorType.get(shape, element),
                                  ir.DenseElementsAttr.get_splat(
                                      ir.VectorType.get(shape, element), attribute))
        return arith.constant(element, attribute)

    def as_type(register_type, element):
        if isinstance(register_type, ir.VectorType):
            return ir.VectorType.get(ir.VectorType(register_type).shape, element)
        return element

    def polynomial(register):
        kind = register.type
        c = lambda v: splat(v, kind, f32)  # noqa: E731
        x = arith.maxnumf(register, c(LOWEST))
        t = arith.addf(x, c(ROUNDING))
        f = arith.subf(x, arith.subf(t, c(ROUNDING)))
        c0, c1, c2, c3 = COEFFICIENTS
        p = mlir_math.fma(c(c3), f, c(c2))
        p = mlir_math.fma(p, f, c(c1))
        p = mlir_math.fma(p, f, c(c0))
        int_kind = as_type(kind, i32)
        bits = arith.addi(arith.bitcast(int_kind, p),
                          arith.shli(arith.bitcast(int_kind, t), splat(23, kind, i32)))
        return arith.bitcast(kind, bits)

    # What `jnp.exp2` lowers to under approx_math, per register.
    transcendental = mgpu.FragmentedArray._lift_fast_instr("ex2.approx.ftz.f32")

    registers = np.empty_like(x.registers)
    for number, (index, register) in enumerate(np.ndenumerate(x.registers)):
        use_fma = number % period < on_fma
        registers[index] = polynomial(register) if use_fma else transcendental(register)
    return mgpu.FragmentedArray(_registers=registers, _layout=x.layout, _is_signed=None)


def exp2(x, share: tuple[int, int] | None, *, interpret: bool = False):
    """exp2 of a float32 tile in the wgmma layout, `share` = (a, b): a of every b registers
    on the FMA units; None or a == 0: all on the transcendental unit (`jnp.exp2`)."""
    if share is None or share[0] == 0:
        return jnp.exp2(x)
    if interpret:
        return exp2_reference(x)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32,
                                                          layout=layout))
    def run(_, tile):
        return _on_registers(tile, share)

    return run(x)
