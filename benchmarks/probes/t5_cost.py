"""Probe: where the T5 score_mod's forward cost goes on the Triton kernel (H100)."""
import math, time, json, os
import jax, jax.numpy as jnp, numpy as np
import pallas_flex as pf

B, S, H, D = 4, 4096, 16, 128
key = jax.random.PRNGKey(0)
q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in jax.random.split(key, 3))
table = jax.random.normal(key, (H, 32), jnp.float32)
bm = pf.create_block_mask(pf.masks.causal_mask, None, None, S, S)

def bucket_div(rel):
    nb, me = 32, 16
    distance = -jnp.minimum(rel, 0)
    is_small = distance < me
    lr = jnp.log(jnp.maximum(distance, me).astype(jnp.float32) / me)
    large = me + (lr / math.log(128 / me) * (nb - me)).astype(jnp.int32)
    return jnp.where(is_small, distance, jnp.minimum(large, nb - 1))

def bucket_mul(rel):
    nb, me = 32, 16
    distance = -jnp.minimum(rel, 0)
    is_small = distance < me
    lr = jnp.log(jnp.maximum(distance, me).astype(jnp.float32) * (1 / me))
    large = me + (lr * ((nb - me) / math.log(128 / me))).astype(jnp.int32)
    return jnp.where(is_small, distance, jnp.minimum(large, nb - 1))

mods = {
    "causal": None,
    "t5": pf.scores.t5_relative_bias(table, bidirectional=False),
    "bucket_no_gather": lambda s, b, h, qi, ki: s + bucket_div(ki - qi).astype(jnp.float32) * 0.01,
    "bucket_mul_no_gather": lambda s, b, h, qi, ki: s + bucket_mul(ki - qi).astype(jnp.float32) * 0.01,
    "gather_simple": lambda s, b, h, qi, ki: s + table[h, jnp.clip(ki - qi + 16, 0, 31)],
    "t5_mul": lambda s, b, h, qi, ki: s + table[h, bucket_mul(ki - qi)],
}
results = {}
for name, mod in mods.items():
    f = jax.jit(lambda q, k, v, mod=mod: pf.flex_attention(q, k, v, mod, bm))
    f(q, k, v).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            out = f(q, k, v)
        out.block_until_ready()
        times.append((time.perf_counter() - t) / 10 * 1e3)
    results[name] = min(times)
    print(name, round(min(times), 3), pf.explain(q, k, v, score_mod=mod, block_mask=bm).splitlines()[0] if hasattr(pf, "explain") else "", flush=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "t5_cost.json"), "w"))
