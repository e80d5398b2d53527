"""Maintainer tools of a checkout (the benchmark harness ships with the package:
`pallas-flex bench --help`, pallas_flex/bench/).

results/          the latest run of each suite per GPU (`<gpu>/<suite>.json`) and the tables
                  generated from them (`pallas-flex bench report`)
inspect_kernels.py lowers the kernels for a GPU on any machine and, with pip `triton`,
                  compiles them: registers, spills, shared memory, the shared-memory audit
                  (python -m benchmarks.inspect_kernels --help; docs/design.md §8)
"""
