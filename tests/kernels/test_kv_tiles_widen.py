"""8-bit cache tiles widened to the queries' 16-bit type (`kv_tiles.widen`): on the GPU
by inline PTX four elements at a time, which must give exactly what a conversion
gives, for every one of the 256 byte values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_flex as pf
from pallas_flex.kernels import kv_tiles

PAIRS = [(jnp.int8, jnp.bfloat16), (jnp.int8, jnp.float16),
         (jnp.float8_e4m3fn, jnp.bfloat16), (jnp.float8_e4m3fn, jnp.float16)]


def _every_byte(source, shape=(16, 64)):
    """Each byte value 4 times, in an order that puts unlike bytes in one register."""
    values = (np.arange(np.prod(shape)) * 37 % 256).astype(np.uint8).reshape(shape)
    return jax.lax.bitcast_convert_type(jnp.asarray(values), source)


def _widen_in_kernel(tile, target, interpret):
    def kernel(x_ref, o_ref):
        o_ref[...] = kv_tiles.widen(x_ref[...], target, interpret)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(tile.shape, target),
                          interpret=interpret)(tile)


def _same_values(got, want):
    got, want = (np.asarray(x.astype(jnp.float32)) for x in (got, want))
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # -0.0 stays -0.0 (int8 has none; float8's 0x80).
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


@pytest.mark.gpu
@pytest.mark.parametrize("source,target", PAIRS, ids=lambda d: jnp.dtype(d).name)
def test_ptx_widening_equals_conversion_for_every_byte(source, target):
    tile = _every_byte(source)
    _same_values(_widen_in_kernel(tile, target, interpret=False), tile.astype(target))


@pytest.mark.parametrize("source,target", PAIRS, ids=lambda d: jnp.dtype(d).name)
def test_interpret_mode_widens_by_conversion(source, target):
    tile = _every_byte(source)
    _same_values(_widen_in_kernel(tile, target, interpret=True), tile.astype(target))


def test_the_kernels_lower_with_the_ptx(monkeypatch):
    """The quantized decode's Triton kernel carries the PTX (lowered for CUDA on the
    CPU): int8 and float8 caches under bfloat16 and float16 queries."""
    from jax._src.pallas.triton import pallas_call_registration
    from jax.experimental.pallas import triton as pallas_triton

    from pallas_flex.kernels import device
    monkeypatch.setattr(device, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: pallas_triton.get_gpu_info_from_version(
                            pallas_triton.GpuVersion.H100))
    for source, target in PAIRS:
        q = jax.ShapeDtypeStruct((2, 1, 8, 64), target)
        k = jax.ShapeDtypeStruct((2, 256, 2, 64), source)
        scales = jax.ShapeDtypeStruct((2, 256, 2), jnp.float32)
        with pf.api.lowering_for_gpu():
            text = jax.jit(lambda q, k, v, k_scales, v_scales: pf.flex_attention(
                q, k, v, k_scales=k_scales, v_scales=v_scales, backend="pallas")).trace(
                q, k, k, scales, scales).lower(lowering_platforms=("cuda",)).as_text()
        marker = "prmt.b32" if source == jnp.int8 else "cvt.rn.f16x2.e4m3x2"
        assert marker in text, (source, target)
