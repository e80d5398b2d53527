"""Is a Mosaic GPU (wgmma + TMA, warp-specialized) kernel worth building? Times JAX's own
Mosaic GPU FlashAttention (`jax.experimental.pallas.ops.gpu.attention_mgpu`, dense or
causal only) next to our Triton-lowered kernels and cuDNN on one shape, forward and
forward+backward (its backward has no causal form).

Usage: PYTHONPATH=$PWD python3 -m benchmarks.probe_mosaic [--out probe.json]
f16 (that kernel's shared-memory buffers are f16), B4 H16 S4096 D128 by default.
"""
import argparse
import json
import traceback

import jax
import jax.numpy as jnp

import pallas_flex as pf
from pallas_flex import masks
from benchmarks import jax_bench
from benchmarks.jax_bench import time_ms


def _mosaic(causal, block_kv, backward_blocks=None):
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=causal,
        **(backward_blocks or {}))
    return lambda q, k, v: attention_mgpu.attention(q, k, v, config)


def _forward_backward(attend):
    return jax.jit(jax_bench._forward_backward(attend))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    shape = (args.batch, args.length, args.heads, args.head_dim)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.float16) for key in keys)
    rows = []

    def record(name, fn, *fn_args):
        try:
            ms = time_ms(fn, *fn_args)
        except Exception as error:  # a config the kernel refuses: note it, go on
            traceback.print_exc()
            rows.append(dict(name=name, error=str(error)[:300]))
            print(f"{name:40s} error {str(error)[:120]}", flush=True)
            return
        rows.append(dict(name=name, ms=ms))
        print(f"{name:40s} {ms:8.3f} ms", flush=True)

    block_masks = {
        "noop": pf.create_block_mask(masks.noop_mask, None, None, args.length, args.length),
        "causal": pf.create_block_mask(masks.causal_mask, None, None, args.length, args.length),
    }
    for variant, causal in [("noop", False), ("causal", True)]:
        block_mask = block_masks[variant]

        def ours(q, k, v, block_mask=block_mask):
            return pf.flex_attention(q, k, v, block_mask=block_mask)

        def cudnn(q, k, v, causal=causal):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                implementation="cudnn")

        record(f"fwd {variant} ours", jax.jit(ours), q, k, v)
        record(f"fwd {variant} cudnn", jax.jit(cudnn), q, k, v)
        for block_kv in (64, 128, 256):
            record(f"fwd {variant} mosaic 64x2/{block_kv}", jax.jit(_mosaic(causal, block_kv)),
                   q, k, v)
        record(f"fwd_bwd {variant} ours", _forward_backward(ours), q, k, v, d_out)
        record(f"fwd_bwd {variant} cudnn", _forward_backward(cudnn), q, k, v, d_out)
        if not causal:
            for blocks in [(64, 128, 64, 128), (64, 64, 64, 64), (128, 64, 64, 128)]:
                backward_blocks = dict(zip(("block_q_dkv", "block_kv_dkv", "block_q_dq",
                                            "block_kv_dq"), blocks))
                record(f"fwd_bwd {variant} mosaic bwd {blocks}",
                       _forward_backward(_mosaic(False, 128, backward_blocks)), q, k, v, d_out)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           shape=shape, dtype="float16", rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
