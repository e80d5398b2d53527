"""The benchmark harness, shipped with the package: `pallas-flex bench --help`.

cases.py      shapes, variants, inputs and FLOPs as numpy data (the same numbers for every
              framework)
jax_suites.py every suite's JAX side: pallas_flex, cuDNN, JAX's paged_attention, XLA paths
torch_peer.py PyTorch FlexAttention in a process of its own (optional: torch absent is fine)
timing.py     the clock (median of timed loops; paired rounds)
cli.py        runs suites, merges peers, writes <results>/<gpu>/<suite>.json
report.py     Markdown tables and plots from the results files
ab.py         A/B of kernel options on one case in paired rounds (a maintainer's tool)
multi_device.py  the multi-GPU suite (context parallelism, batch/head sharding)
machine_state.py the GPU's clocks and load beside each run
"""
