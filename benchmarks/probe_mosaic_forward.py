"""Our Mosaic GPU forward (`kernels/forward_mosaic.py`) against our Triton forward and
cuDNN, per variant, on the GPU: time and the largest difference from the Triton output.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.probe_mosaic_forward [--out probe.json]
  [--head-dim 128] [--q-heads 16 --kv-heads 16] [--stages 0]
"""
import argparse
import json
import traceback

import jax
import jax.numpy as jnp

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels import forward, forward_mosaic
from pallas_flex.kernels.config import resolve_options
from pallas_flex.masks.mod_program import SCORE, make_mod_program
from benchmarks import suites
from benchmarks.tune_forward import time_ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--stages", type=int, default=0)
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument("--hand-over", choices=("auto", "early", "late"), default="auto",
                        help="forward_mosaic.HAND_OVER_BEFORE_SCORES_LAND: None/True/False")
    parser.add_argument("--no-slice-reads", action="store_true",
                        help="forward_mosaic.SLICE_READS = False (document masks on Triton)")
    parser.add_argument("--grid-order", default=forward_mosaic.GRID_ORDER)
    parser.add_argument("--variants", default="noop,causal,sliding_window,prefix_lm,alibi,softcap")
    args = parser.parse_args()
    length, dim = args.length, args.head_dim
    forward_mosaic.GRID_ORDER = args.grid_order
    forward_mosaic.HAND_OVER_BEFORE_SCORES_LAND = {
        "auto": None, "early": True, "late": False}[args.hand_over]
    forward_mosaic.SLICE_READS = not args.no_slice_reads
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (args.batch, length, args.q_heads, dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (args.batch, length, args.kv_heads, dim), jnp.bfloat16)
            for key in keys[1:])
    all_variants = {
        "noop": (masks.noop_mask, None, False),
        "causal": (masks.causal_mask, None, True),
        "sliding_window": (masks.sliding_window(1024), None, None),
        "prefix_lm": (masks.prefix_lm(1024), None, None),
        "alibi": (masks.causal_mask, masks.alibi(args.q_heads), None),
        "softcap": (masks.causal_mask, masks.tanh_softcap(30.0), None),
        # The harness's document variant: 12 packed documents, causal within each.
        "document": (masks.and_masks(masks.document_mask(jnp.asarray(
            suites.document_ids(length, 12))), masks.causal_mask), None, None),
    }
    scale = dim ** -0.5
    options = resolve_options({"forward_kernel": "triton"}, dim)
    rows = []
    for name in args.variants.split(","):
        mask, score, cudnn_causal = all_variants[name]
        block_mask = pf.create_block_mask(mask, None, None, length, length)
        score_program = make_mod_program(score, SCORE) if score is not None else None
        reason = forward_mosaic.unsupported_reason(q, k, v, block_mask, score_program,
                                                   interpret=False)
        row = dict(variant=name, unsupported=reason)
        try:
            mosaic = jax.jit(lambda q, k, v, bm, sp: forward_mosaic.flex_attention_forward_mosaic(
                q, k, v, bm, sp, scale=scale, interpret=False, num_stages=args.stages))
            triton = jax.jit(lambda q, k, v, bm, sp: forward.flex_attention_forward(
                q, k, v, bm, sp, scale=scale, options=options, interpret=False))
            out_m, lse_m = mosaic(q, k, v, block_mask, score_program)
            out_t, lse_t = triton(q, k, v, block_mask, score_program)
            row["max_abs_diff_out"] = float(jnp.max(jnp.abs(out_m.astype(jnp.float32)
                                                            - out_t.astype(jnp.float32))))
            row["max_abs_diff_lse"] = float(jnp.max(jnp.abs(lse_m - lse_t)))
            row["mosaic_ms"] = time_ms(mosaic, q, k, v, block_mask, score_program)
            if not args.no_triton:
                row["triton_ms"] = time_ms(triton, q, k, v, block_mask, score_program)
            if cudnn_causal is not None and args.q_heads == args.kv_heads:
                cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=cudnn_causal, implementation="cudnn"))
                row["cudnn_ms"] = time_ms(cudnn, q, k, v)
        except Exception as error:
            traceback.print_exc()
            row["error"] = str(error)[:2000]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           args=vars(args), rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
