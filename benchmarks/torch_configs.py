"""Prints the Triton launch parameters PyTorch FlexAttention compiles for one shape.

Usage (GPU machine): PYTHONPATH=$PWD python3 -m benchmarks.torch_configs --head-dim 64 \
    [--copy-to $OUT/torch_kernels]
Compiles torch's flex_attention forward and backward with a fresh Triton cache and
reads each kernel's metadata (warps, stages, shared memory) and block constants from
the cache: what our config table is compared with. Never imports jax.
"""
import argparse
import glob
import json
import os
import re
import shutil
import tempfile


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--copy-to", default=None,
                        help="copy each flex kernel's .ttgir/.ptx into this folder")
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="triton_cache_")
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_cache_")

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    block_mask = None
    if args.causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None,
                                       None, args.seq_len, args.seq_len)
    compiled = torch.compile(flex_attention)
    out = compiled(q, k, v, block_mask=block_mask)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()

    for path in sorted(glob.glob(os.path.join(cache, "*", "*.json"))):
        if os.path.basename(path).startswith("__grp__"):
            continue
        with open(path) as f:
            meta = json.load(f)
        name = meta.get("name", "")
        if "flex" not in name:
            continue
        source = glob.glob(os.path.join(os.path.dirname(path), "*.ttir"))
        constants = {}
        if source:
            text = open(source[0]).read()
            # Block sizes appear as the extents of tensors; record the distinct ones.
            constants["tensor_shapes"] = sorted(set(re.findall(r"tensor<(\d+x\d+)x", text)))[:12]
        if args.copy_to:
            os.makedirs(args.copy_to, exist_ok=True)
            for suffix in ("ttgir", "ptx"):
                for found in glob.glob(os.path.join(os.path.dirname(path), f"*.{suffix}")):
                    shutil.copy(found, os.path.join(args.copy_to, os.path.basename(found)))
        print(json.dumps(dict(name=name, num_warps=meta.get("num_warps"),
                              num_stages=meta.get("num_stages"), shared=meta.get("shared"),
                              **constants)))


if __name__ == "__main__":
    main()
