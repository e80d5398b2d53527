"""Quick GPU check: compile every backend path, compare with the reference, time a few."""
import time, json, os, sys
import jax, jax.numpy as jnp
import pallas_flex as pf
from pallas_flex.kernels.reference import reference_attention

print(jax.devices())
key = jax.random.PRNGKey(0)
def rnd(i, shape, dtype): return jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32).astype(dtype)
B,Sq,Skv,Hq,Hkv,D,Dv = 2,300,257,8,2,96,64
dtype = jnp.bfloat16
q, k, v = rnd(0,(B,Sq,Hq,D),dtype), rnd(1,(B,Skv,Hkv,D),dtype), rnd(2,(B,Skv,Hkv,Dv),dtype)
slopes = jnp.linspace(0.1, 0.5, Hq)
doc = (jnp.arange(Sq)//53).astype(jnp.int32)
cases = {
  "noop": (None, None),
  "causal": (lambda b,h,qi,ki: qi >= ki, None),
  "doc_alibi": (lambda b,h,qi,ki: (qi >= ki) & (doc[qi]==doc[ki % Sq]), lambda s,b,h,qi,ki: s + slopes[h]*(ki-qi)),
  "softcap": (lambda b,h,qi,ki: qi >= ki, lambda s,b,h,qi,ki: 20*jnp.tanh(s/20)),
}
for name,(mm,sm) in cases.items():
    ref,_ = reference_attention(q.astype(jnp.float32),k.astype(jnp.float32),v.astype(jnp.float32),mask_mod=mm,score_mod=sm)
    try:
        out = pf.attention(q,k,v,mask_mod=mm,score_mod=sm,backend="pallas")
        err = float(jnp.abs(out.astype(jnp.float32)-ref).max())
        print(f"{name}: max err {err:.4f}", flush=True)
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)

def bench(fn, *args, iters=20):
    out = fn(*args); jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(iters): out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter()-t)/iters*1e3
B,H,S,D = 4,16,4096,128
q, k, v = (rnd(i,(B,S,H,D),jnp.bfloat16) for i in range(3))
causal = lambda b,h,qi,ki: qi >= ki
bm = pf.create_block_mask(causal, None, None, S, S)
noop = pf.create_block_mask(None, None, None, S, S)
for opts in [dict(block_q=128, block_kv=64, num_warps=4, num_stages=2), dict(block_q=128, block_kv=64, num_warps=8, num_stages=3), dict(block_q=128, block_kv=128, num_warps=8, num_stages=2)]:
    f = jax.jit(lambda q,k,v,bm: pf.flex_attention(q,k,v,block_mask=bm,kernel_options=opts))
    print(opts, "causal %.3f ms" % bench(f,q,k,v,bm), "noop %.3f ms" % bench(f,q,k,v,noop), flush=True)
cud = jax.jit(lambda q,k,v: jax.nn.dot_product_attention(q,k,v,is_causal=True,implementation="cudnn"))
print("cudnn causal %.3f ms" % bench(cud,q,k,v))
t=time.perf_counter(); bm2 = pf.create_block_mask(causal, None, None, 131072, 131072); jax.block_until_ready(bm2.kv_indices); print("bm 128k first", time.perf_counter()-t)
t=time.perf_counter(); bm2 = pf.create_block_mask(causal, None, None, 131072, 131072); jax.block_until_ready(bm2.kv_indices); print("bm 128k second", time.perf_counter()-t)
