"""A/B of the key-stage latent decode's register split (issue 20; ptxas spills 100-156
B at (240, 224, 40)). Delete after recording the winner at
`decode_latent_stage_mosaic._REGISTERS`.

    MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=$PWD python3 -m benchmarks.latent_registers_ab
    python -m benchmarks.latent_registers_ab --lower          # CUDA lowering, CPU

DeepSeek's latent decode (Hq 128, one latent KV head, D 576, Dv 512 read in place,
causal at the row's end) at B16 S4096 and B64 S32768: the scores / values / memory
warpgroups' registers (240, 224, 40) against (248, 216, 40) and (232, 232, 40) (each
sums to 504, `mosaic_tiles.registers_fit`), AOT-compiled after `jax.clear_caches()`,
timed in paired rounds; ms, and the largest output difference to the first."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench.timing import time_paired
from pallas_flex.kernels import decode_latent_stage_mosaic, device
from pallas_flex.kernels.mosaic_tiles import registers_fit

SPLITS = [(240, 224, 40), (248, 216, 40), (232, 232, 40)]
SHAPES = [(16, 4096), (64, 32768)]  # batch, length


def _decode(q, latent, block_mask):
    return pf.flex_attention(q, latent, None, block_mask=block_mask, backend="pallas",
                             value_dim=512, kernel_options={"decode_kernel": "mosaic"})


def main(lower_only=False):
    assert all(registers_fit(split) for split in SPLITS)
    if lower_only:
        device.compute_capability = lambda: (9, 0)
    saved = decode_latent_stage_mosaic._REGISTERS
    for batch, length in SHAPES:
        keys = jax.random.split(jax.random.PRNGKey(0), 2)
        shapes = ((batch, 1, 128, 576), (batch, length, 1, 576))
        if lower_only:
            q, latent = (jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes)
        else:
            q, latent = (jax.random.normal(key, shape, jnp.bfloat16)
                         for key, shape in zip(keys, shapes))
        positions = jnp.full((batch,), length - 1, jnp.int32)
        block_mask = pf.create_block_mask(pf.masks.offset(pf.masks.causal_mask, positions),
                                          batch, None, 1, length)
        args = (q, latent, block_mask)
        executables = {}
        try:
            for split in SPLITS:
                decode_latent_stage_mosaic._REGISTERS = split
                jax.clear_caches()
                if lower_only:
                    with pf.api.lowering_for_gpu():
                        jax.jit(_decode).trace(*args).lower(lowering_platforms=("cuda",))
                    continue
                print(f"B{batch} S{length} registers {split}: compiling", flush=True)
                executables[split] = jax.jit(_decode).lower(*args).compile()
        finally:
            decode_latent_stage_mosaic._REGISTERS = saved
        if lower_only:
            print(f"B{batch} S{length}: every split lowered", flush=True)
            continue
        outputs = {split: np.asarray(run(*args), np.float32)
                   for split, run in executables.items()}
        timed = time_paired({split: (run, args) for split, run in executables.items()},
                            rounds=7)
        first = outputs[SPLITS[0]]
        print(f"B{batch} S{length} latent decode ms: " + ", ".join(
            f"{split} {entry['ms']:.4f} (max diff "
            f"{float(np.max(np.abs(outputs[split] - first))):.1e})"
            for split, entry in timed.items()), flush=True)


if __name__ == "__main__":
    main(lower_only="--lower" in sys.argv[1:])
