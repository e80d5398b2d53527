"""What the GPU a kernel is configured for can hold: its shared memory and its dtypes.

Kernel configurations (tiles, pipelining depth) are chosen to fit the shared memory one
program may use (`kernels/shared_memory.py`). That budget is the device's own, read
from its compute capability, unless the environment variable
`PALLAS_FLEX_SHARED_MEMORY_KIB` sets another: on an H100 it runs what an A100 (164),
an sm_89 card (100) or a T4 (64) would run. A budget below the device's own also keeps
calls off the Hopper-only Mosaic GPU forward (`mosaic_allowed`). Without a GPU (the
Pallas interpreter on a CPU) configurations are planned as for an H100.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

SHARED_MEMORY_ENVIRONMENT_VARIABLE = "PALLAS_FLEX_SHARED_MEMORY_KIB"

# Shared memory one thread block may use (the opt-in maximum, as Triton and XLA report
# it), by compute capability (CUDA programming guide, "Technical Specifications").
_SHARED_MEMORY_PER_BLOCK = {
    (7, 0): 96 * 1024,       # V100
    (7, 5): 64 * 1024,       # T4, RTX 20
    (8, 0): 163 * 1024,      # A100 (164 KiB per SM, 163 per block)
    (8, 6): 99 * 1024,       # RTX 30, A10, A40
    (8, 7): 163 * 1024,      # Jetson Orin
    (8, 9): 99 * 1024,       # L4, L40, RTX 40
    (9, 0): 227 * 1024,      # H100, H200: 232448 bytes
    (10, 0): 227 * 1024,     # B200
    (12, 0): 99 * 1024,      # RTX 50
}
HOPPER = (9, 0)
_UNKNOWN_GPU_SHARED_MEMORY = 99 * 1024  # the smallest of the recent generations


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the default device if it is a CUDA GPU, else None."""
    if jax.default_backend() != "gpu":
        return None
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if not capability:
        return None
    major, _, minor = str(capability).partition(".")
    return int(major), int(minor or 0)


def multiprocessor_count() -> int:
    """Streaming multiprocessors of the default device if it is a CUDA GPU, else an
    H100's 132."""
    if jax.default_backend() != "gpu":
        return 132
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def device_shared_memory_bytes() -> int:
    """Shared memory per block of the default device (an H100's without a GPU)."""
    capability = compute_capability()
    if capability is None:
        return _SHARED_MEMORY_PER_BLOCK[HOPPER]
    return _SHARED_MEMORY_PER_BLOCK.get(capability, _UNKNOWN_GPU_SHARED_MEMORY)


def shared_memory_budget() -> int:
    """Bytes of shared memory a kernel configuration may use: the device's, or
    `PALLAS_FLEX_SHARED_MEMORY_KIB` KiB when that is set (read at every call, so it
    takes effect on the next call that compiles)."""
    setting = os.environ.get(SHARED_MEMORY_ENVIRONMENT_VARIABLE, "").strip()
    if not setting:
        return device_shared_memory_bytes()
    try:
        kib = int(setting)
    except ValueError:
        kib = 0
    if kib < 16:
        raise ValueError(f"{SHARED_MEMORY_ENVIRONMENT_VARIABLE} must be a whole number of "
                         f"KiB, at least 16, got {setting!r}")
    return kib * 1024


def mosaic_allowed(budget: int) -> bool:
    """The Mosaic GPU kernels are written for Hopper's full shared memory: a smaller
    budget asks for what a smaller GPU would run (the Triton kernels)."""
    return budget >= device_shared_memory_bytes()


# The input dtypes every kernel (and the paged cache) takes.
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def supports_bfloat16() -> bool:
    """bfloat16 tensor-core math needs compute capability 8.0 (Ampere) or later."""
    capability = compute_capability()
    return capability is None or capability >= (8, 0)
