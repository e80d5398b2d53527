"""A/B of the two latent decode kernels on one H100/H200, to decide
`decode_latent_mosaic.VALUES_FROM_KEY_STAGE` (then delete this script and record the
figures where that constant is defined).

    PYTHONPATH=$PWD python3 -m benchmarks.latent_key_stage_ab

DeepSeek's shape (Hq 128, D 576, Dv 512, the values the latent's first 512 columns), the
shapes of `pallas-flex bench latent` (B 16/64/128, S 4096/32768), contiguous and on
shuffled pages of 64: the split-column kernel (flag off) against the key-stage kernel
(`decode_latent_stage_mosaic`, flag on), each AOT-compiled after `jax.clear_caches()`
(the flag is read when a call is traced, and pf.flex_attention's inner jit is keyed on
its arguments only), timed in paired rounds of 8 chained steps a call; ms a step,
TFLOP/s, and the largest difference between the two outputs."""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench.jax_suites import _shuffled_pages
from pallas_flex.kernels import decode_latent_mosaic

Q_HEADS, DIM, VALUE_DIM, STEPS = 128, 576, 512, 8


def _steps(paged):
    def run(q, latent, cache, block_mask):
        query = q
        for _ in range(STEPS):
            if paged:
                out = pf.paged.paged_flex_attention(query, cache, block_mask=block_mask)
            else:
                out = pf.flex_attention(query, latent, None, block_mask=block_mask,
                                        value_dim=VALUE_DIM)
            query = jnp.pad(out, ((0, 0), (0, 0), (0, 0), (0, DIM - VALUE_DIM)))
        return out
    return run


def _per_step_ms(executable, args, iters=10):
    jax.block_until_ready(executable(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = executable(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters / STEPS * 1e3


def main():
    for length in (4096, 32768):
        for batch in (16, 64, 128):
            keys = jax.random.split(jax.random.PRNGKey(0), 2)
            q = jax.random.normal(keys[0], (batch, 1, Q_HEADS, DIM), jnp.bfloat16)
            latent = jax.random.normal(keys[1], (batch, length, 1, DIM), jnp.bfloat16)
            block_mask = pf.create_block_mask(
                pf.masks.offset(pf.masks.causal_mask, jnp.full((batch,), length - 1, jnp.int32)),
                batch, None, 1, length)
            pages, table, owner = _shuffled_pages(latent, 64)
            cache = pf.paged.PagedKVCache(pages, None, table,
                                          jnp.full((batch,), length, jnp.int32), owner,
                                          latent_value_dim=VALUE_DIM)
            flops = 2 * batch * length * Q_HEADS * (DIM + VALUE_DIM)
            for paged in (False, True):
                args = (q, latent, cache, block_mask)
                executables, outputs = {}, {}
                try:
                    for stage in (False, True):
                        decode_latent_mosaic.VALUES_FROM_KEY_STAGE = stage
                        jax.clear_caches()
                        executables[stage] = jax.jit(_steps(paged)).lower(*args).compile()
                        outputs[stage] = np.asarray(executables[stage](*args), np.float32)
                except Exception as error:  # a row that fails says why; the others run
                    print(f"B{batch} S{length} paged={paged}: {type(error).__name__}: "
                          f"{str(error)[:400]}", flush=True)
                    continue
                finally:
                    decode_latent_mosaic.VALUES_FROM_KEY_STAGE = False
                rounds = {False: [], True: []}
                for _ in range(7):
                    for stage in (False, True):
                        rounds[stage].append(_per_step_ms(executables[stage], args))
                ms = {stage: statistics.median(r) for stage, r in rounds.items()}
                print(f"B{batch} S{length} {'paged 64' if paged else 'contiguous'}: split "
                      f"columns {ms[False]:.4f} ms ({flops / ms[False] / 1e9:.0f} TFLOP/s), "
                      f"key stage {ms[True]:.4f} ({flops / ms[True] / 1e9:.0f}), speed-up "
                      f"{ms[False] / ms[True]:.3f}, max |diff| "
                      f"{float(np.max(np.abs(outputs[True] - outputs[False]))):.3g}",
                      flush=True)


if __name__ == "__main__":
    main()
