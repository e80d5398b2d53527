"""Times the backward (and the forward kernel) for kernel-option sets, on the GPU.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.probe_backward [--out probe.json]
B4 H16 S4096 D128 bf16 by default. For each kernel-option set and variant, in ms (`--parts`):
`flex_attention_backward` (delta, padding and the kernels) and the forward kernel.
`--separate` runs dQ and dK/dV as two launches instead of one, `--no-prefetch` reads
tile indices in the iteration that uses them, `--convert-tiles` converts ALiBi's index
differences on whole tiles, `--scale-first` scales scores before the forward's softmax,
`--walk-order masked-first|full-first` sets which blocks the backward walks first: A/B
switches for what they replaced.
The backward here differentiates the score_mod's captured arrays too (ALiBi's slopes:
atomics per tile), which training with constant slopes skips: its ALiBi rows cost more
than the same backward under `jax.grad` of q, k, v only.
"""
import argparse
import json

import jax
import jax.numpy as jnp

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels import backward, block_walk, forward, tile_mods
from pallas_flex.kernels.config import resolve_options
from pallas_flex.masks.mod_program import SCORE, make_mod_program
from benchmarks.tune_forward import time_ms


def _dq(block_q, block_kv, warps, stages):
    return dict(backward_block_q=block_q, backward_block_kv=block_kv,
                backward_num_warps=warps, backward_num_stages=stages)


def _dkdv(block_kv, block_q, warps, stages):
    return dict(backward_dkdv_block_q=block_q, backward_dkdv_block_kv=block_kv,
                backward_dkdv_num_warps=warps, backward_dkdv_num_stages=stages)


# name -> kernel_options over the defaults. dq_<q rows>x<kv rows>_<warps>w<stages>s,
# dkdv_<kv rows>x<q rows>_<warps>w<stages>s, fwd_<q rows>x<kv rows>_<warps>w<stages>s.
# The dq_ warps/stages set the one launch's (both kinds) unless --separate or GQA.
CONFIGS = {"default": {}}
for _tiles in [(64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4), (128, 64, 8, 3),
               (128, 32, 8, 3), (128, 32, 8, 4), (64, 64, 4, 3)]:
    CONFIGS["dq_%dx%d_%dw%ds" % _tiles] = _dq(*_tiles)
    CONFIGS["dkdv_%dx%d_%dw%ds" % _tiles] = _dkdv(*_tiles)
# Both program kinds' tiles at once (the one launch's warps/stages): for small head dims.
for _rows, _walked, _warps, _stages in [(128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3),
                                        (128, 128, 8, 4)]:
    CONFIGS["both_%dx%d_%dw%ds" % (_rows, _walked, _warps, _stages)] = dict(
        _dq(_rows, _walked, _warps, _stages), **_dkdv(_rows, _walked, _warps, _stages))
# dQ tiles <q rows>x<kv rows> with dK/dV tiles <kv rows>x<q rows>, one launch's warps/stages.
for _dq_q, _dq_kv, _kv, _q, _warps, _stages in [
        (128, 128, 128, 64, 8, 3), (128, 64, 128, 64, 8, 3), (128, 128, 128, 64, 8, 2),
        (128, 64, 128, 64, 8, 2), (128, 128, 64, 128, 8, 3), (64, 128, 128, 64, 8, 3),
        (128, 128, 128, 64, 8, 4), (128, 128, 128, 32, 8, 3)]:
    CONFIGS["dq_%dx%d_dkdv_%dx%d_%dw%ds" % (_dq_q, _dq_kv, _kv, _q, _warps, _stages)] = dict(
        _dq(_dq_q, _dq_kv, _warps, _stages), **_dkdv(_kv, _q, _warps, _stages))
for _tiles in [(128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
               (128, 128, 8, 2), (128, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3),
               (128, 32, 4, 3), (128, 32, 4, 2), (128, 32, 4, 4), (64, 64, 4, 2), (64, 64, 4, 4),
               (64, 128, 4, 3),
               (64, 128, 4, 2)]:
    CONFIGS["fwd_%dx%d_%dw%ds" % _tiles] = dict(zip(("block_q", "block_kv", "num_warps",
                                                     "num_stages"), _tiles))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--variants", default="noop,causal")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=0, help="0: as many as q heads")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="tile loops read each index in the iteration that uses it")
    parser.add_argument("--no-const-grads", action="store_true",
                        help="skip the gradients of the score_mod's captured arrays (as "
                             "jax.grad of q, k, v only does)")
    parser.add_argument("--parts", default="forward,backward")
    parser.add_argument("--separate", action="store_true",
                        help="dQ and dK/dV in two launches instead of one")
    parser.add_argument("--convert-tiles", action="store_true",
                        help="convert int index differences on whole tiles")
    parser.add_argument("--scale-first", action="store_true",
                        help="forward multiplies scores by the scale before the softmax")
    parser.add_argument("--walk-order", choices=["default", "masked-first", "full-first"],
                        default="default",
                        help="which blocks the backward walks first (default: the head "
                             "dim's backward_masked_first)")
    args = parser.parse_args()
    block_walk.PREFETCH_INDICES = not args.no_prefetch
    backward.FUSED_LAUNCH = not args.separate
    tile_mods.CONVERT_INDEX_VECTORS = not args.convert_tiles
    forward.SCALE_IN_EXPONENT = not args.scale_first
    batch, heads, length, dim = args.batch, args.q_heads, args.seq_len, args.head_dim
    kv_heads = args.kv_heads or heads
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, d_out = (jax.random.normal(key, (batch, length, heads, dim), jnp.bfloat16)
                for key in keys[:2])
    k, v = (jax.random.normal(key, (batch, length, kv_heads, dim), jnp.bfloat16)
            for key in keys[2:])
    variants = {"noop": (None, None), "causal": (masks.causal_mask, None),
                "softcap": (masks.causal_mask, masks.tanh_softcap(30.0)),
                "alibi": (masks.causal_mask, masks.alibi(heads)),
                "prefix_lm": (masks.prefix_lm(1024), None)}
    scale = dim ** -0.5
    rows = []
    for name in args.variants.split(","):
        mask_mod, score_mod = variants[name]
        block_mask = pf.create_block_mask(mask_mod, None, None, length, length)
        out, lse = pf.flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
        score_program = (make_mod_program(score_mod, SCORE) if score_mod is not None
                         else None)
        wanted = ([False] * len(score_program.consts)
                  if args.no_const_grads and score_program is not None else None)
        for config_name in args.configs.split(","):
            options = resolve_options(CONFIGS[config_name], dim)
            if args.walk_order != "default":
                options = options.replace(
                    backward_masked_first=args.walk_order == "masked-first")

            # Arrays are arguments, not closed-over constants (XLA would fold them).
            def whole(q, k, v, out, lse, d_out, block_mask, score_program):
                return backward.flex_attention_backward(
                    q, k, v, out, lse, d_out, None, block_mask, score_program, scale=scale,
                    options=options, interpret=False, wanted_const_grads=wanted)

            arguments = (q, k, v, out, lse, d_out, block_mask, score_program)
            row = dict(variant=name, config=config_name, options=CONFIGS[config_name],
                       prefetch=block_walk.PREFETCH_INDICES, fused=backward.FUSED_LAUNCH,
                       convert_index_vectors=tile_mods.CONVERT_INDEX_VECTORS,
                       scale_in_exponent=forward.SCALE_IN_EXPONENT,
                       masked_first=options.backward_masked_first,
                       const_grads=not args.no_const_grads,
                       q_heads=heads, kv_heads=kv_heads, batch=batch, seq_len=length,
                       head_dim=dim)
            def forward_only(q, k, v, out, lse, d_out, block_mask, score_program):
                return forward.flex_attention_forward(q, k, v, block_mask, score_program,
                                                      scale=scale, options=options,
                                                      interpret=False)

            parts = {"backward": whole, "forward": forward_only}
            for part in args.parts.split(","):
                fn = parts[part]
                try:
                    row[part] = time_ms(jax.jit(fn), *arguments, iters=args.iters)
                except Exception as error:  # one failing config must not end the probe
                    row[part] = float("nan")
                    print("failed", config_name, part, str(error)[:300], flush=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
