"""How much shared memory a Triton kernel configuration needs, and shrinking one to fit.

Triton keeps in shared memory (measured with `benchmarks/inspect_kernels.py` and against
the sizes XLA reports when a launch does not fit; `tests/kernels/test_shared_memory.py`
holds the measured points):

* the operand tiles a program loads before its loop (its own query tile, or its K/V
  tile in the dK/dV programs), once, and twice for float32: float32 dots run as three
  TF32 products, and the low halves of wgmma operands are kept beside the high ones;
* `num_stages` copies of every tile the loop streams (the software pipeline's buffers);
* layout-conversion scratch for captured arrays read at a per-element index (a T5 bucket,
  a relative-position table, a pair bias): a [rows, columns] float32 gather result
  goes through shared memory, two tiles' worth, and three in the dQ programs when the
  array gets a gradient (its scatter-add converts the cotangent tile too). Reads at
  exactly q_idx and kv_idx, loaded as blocks (`tile_mods.block_reads`), are streamed
  tiles of the array's dtype instead, within that allowance (pip triton 3.6.0: bf16
  and float32 pair biases at D32 / 64 / 128, forward and backward);
* reads along one tile axis (a key bias `bias[b, kv_idx]`) in the backward: two float32
  vectors of the tile's longer side, and in the dQ programs, where the array is
  differentiated, a cross-warp sum of its cotangent (up to 8 warps x 4 bytes a
  position).

Two cases keep more (pip triton 3.6.0 compiles of the GPU test matrix, `python -m
benchmarks.inspect_kernels audit`, tests/gpu/results/shared-memory-audit.json):

* float32 with one stage (no software pipeline): a tile is loaded into registers and
  copied into shared memory for each dot that reads it, one at a time, so the loop needs
  one streamed tile, not all of them (on Hopper with 64-row tiles and up, both: wgmma
  reads its shared-memory operands asynchronously); but the held tiles are split into
  TF32 high and low halves in shared memory whatever the rows (mma.sync too): twice the
  held bytes.
* GPUs before Ampere (compute capability < 8.0: T4, V100): Triton 3.6 runs their dots on
  FMA units, not tensor cores, with every operand converted to float32 in shared memory
  (16-bit tiles take twice their bytes) and no async copies (no pipeline): the held
  tiles, and up to two streamed tiles and two [rows, columns] score tiles at a time
  (float32 D128, 32 KV rows owned, 16 walked: 52 KiB, exactly that). It errs high at
  large tiles of small head dims (float16 D32, 128x128: 96 KiB, estimated 193).

Program kinds that share a launch (dQ and dK/dV) share one allocation: the launch needs
the larger of the two. The estimate errs high (by at most a few KiB on the measured
points), so a configuration it accepts compiles.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_flex.kernels import device
from pallas_flex.kernels.config import KernelOptions
from pallas_flex.kernels.tile_mods import captured_read_sites

# Barriers, row statistics and other small buffers of one launch.
_FIXED_BYTES = 1024
# wgmma (Hopper tensor cores) needs 64-row operands per warpgroup: smaller tiles run on
# mma.sync, whose float32 operands are split in registers instead of shared memory.
_WGMMA_ROWS = 64


@dataclasses.dataclass(frozen=True)
class ModReads:
    """How the mods of a call read their captured arrays, as far as shared memory goes.

    tile_reads: reads at a per-element index (an index that varies along both tile
      axes) in the mask_mod and score_mod; tile_gradients: those of them whose array is
      differentiated (the dQ programs scatter-add their cotangent tiles);
      vector_reads: reads at an index that varies along one tile axis; vector_gradients:
      those of them whose array is differentiated (their cotangents are summed across
      warps)."""
    tile_reads: int = 0
    tile_gradients: int = 0
    vector_gradients: int = 0
    vector_reads: int = 0


def _per_element(indices) -> bool:
    shape = ()
    for index in indices:
        shape = jnp.broadcast_shapes(shape, jnp.shape(index))
    return len(shape) == 2 and shape[0] > 1 and shape[1] > 1


def _per_vector(indices) -> bool:
    shape = ()
    for index in indices:
        shape = jnp.broadcast_shapes(shape, jnp.shape(index))
    return len(shape) == 2 and (shape[0] > 1) != (shape[1] > 1)


def mod_reads(mask_program, score_program, differentiated=()) -> ModReads:
    """ModReads of a call; `differentiated`: positions of the score_mod's captured
    arrays that get gradients."""
    tile_reads = tile_gradients = vector_gradients = vector_reads = 0
    for program in (mask_program, score_program):
        for position, indices in captured_read_sites(program):
            differentiated_read = program is score_program and position in differentiated
            if _per_element(indices):
                tile_reads += 1
                tile_gradients += differentiated_read
            elif _per_vector(indices):
                vector_reads += 1
                vector_gradients += differentiated_read
    return ModReads(tile_reads, tile_gradients, vector_gradients, vector_reads)


def planned_capability(capability=None) -> tuple[int, int]:
    """The compute capability the estimate plans for: `capability`, else the device's
    (without a GPU, an H100's)."""
    if capability is not None:
        return tuple(capability)
    return device.compute_capability() or device.HOPPER


def _scratch(rows: int, columns: int, tiles: int) -> int:
    return tiles * rows * columns * 4


def _program_bytes(dtype, *, held_rows: int, held_width: int, streamed_rows: int,
                   head_dim: int, value_dim: int, num_stages: int,
                   capability: tuple[int, int]) -> int:
    """A program that holds [held_rows, held_width] operand tiles and streams
    [streamed_rows, D] and [streamed_rows, Dv] ones on a GPU of compute capability
    `capability` (see the module docstring)."""
    size = jnp.dtype(dtype).itemsize
    float32 = jnp.dtype(dtype) == jnp.float32
    if capability < (8, 0):  # FMA dots: float32 operands; two streamed, two score tiles
        return 4 * (held_rows * held_width + 2 * streamed_rows * max(head_dim, value_dim)
                    + 2 * held_rows * streamed_rows)
    if float32 and num_stages == 1:  # TF32 halves of held tiles, streamed tiles one by one
        # ... except that wgmma (Hopper, 64-row tiles and up) reads its B operand from
        # shared memory asynchronously: the K and V tiles are both there.
        wgmma = capability >= device.HOPPER and held_rows >= _WGMMA_ROWS
        streamed_width = head_dim + value_dim if wgmma else max(head_dim, value_dim)
        return 2 * size * held_rows * held_width + size * streamed_rows * streamed_width
    # float32 dots run as three TF32 products: wgmma keeps the low halves of its held
    # operands beside the high ones (64-row tiles and up); mma.sync splits in registers.
    copies = 2 if float32 and held_rows >= _WGMMA_ROWS else 1
    return (copies * size * held_rows * held_width
            + num_stages * size * streamed_rows * (head_dim + value_dim))


def forward_bytes(*, dtype, head_dim: int, value_dim: int, block_q: int, block_kv: int,
                  num_stages: int, reads: ModReads = ModReads(), query_rows=None,
                  capability=None) -> int:
    """Shared memory of the forward (and decode, ragged) kernels: a [block_q, D] query
    tile held, [block_kv, D + Dv] K/V tiles streamed. `query_rows` overrides block_q for
    kernels whose query tile is not a square tile (decode: heads x positions);
    `capability`: the GPU's compute capability (default: `planned_capability()`)."""
    rows = block_q if query_rows is None else query_rows
    program = _program_bytes(
        dtype, held_rows=rows, held_width=head_dim, streamed_rows=block_kv,
        head_dim=head_dim, value_dim=value_dim, num_stages=num_stages,
        capability=planned_capability(capability))
    return program + _scratch(rows, block_kv, 2 * reads.tile_reads) + _FIXED_BYTES


def backward_bytes(*, dtype, head_dim: int, value_dim: int, dq_tile: tuple[int, int],
                   dkdv_tile: tuple[int, int], dq_stages: int, dkdv_stages: int,
                   reads: ModReads = ModReads(), capability=None) -> int:
    """Shared memory of the backward launch(es): a dQ program holds q and dO tiles and
    streams K/V; a dK/dV program holds K/V tiles and streams q and dO. One launch of
    both kinds, or two launches: the larger kind decides either way."""
    dq_rows, dq_columns = dq_tile
    dkdv_rows, dkdv_columns = dkdv_tile  # (query rows walked, KV rows owned)
    dims = dict(head_dim=head_dim, value_dim=value_dim,
                capability=planned_capability(capability))
    dq = (_program_bytes(dtype, held_rows=dq_rows, held_width=head_dim + value_dim,
                         streamed_rows=dq_columns, num_stages=dq_stages, **dims)
          + _scratch(dq_rows, dq_columns, 2 * reads.tile_reads + reads.tile_gradients)
          + 4 * max(dq_rows, dq_columns) * (2 * reads.vector_reads
                                             + 8 * reads.vector_gradients))
    dkdv = (_program_bytes(dtype, held_rows=dkdv_columns, held_width=head_dim + value_dim,
                           streamed_rows=dkdv_rows, num_stages=dkdv_stages, **dims)
            + _scratch(dkdv_rows, dkdv_columns, 2 * reads.tile_reads)
            + 4 * max(dkdv_rows, dkdv_columns) * 2 * reads.vector_reads)
    return max(dq, dkdv) + _FIXED_BYTES


def effective_backward_stages(stages: int, owned_rows: int) -> int:
    """The pipelining depth a backward launch runs with (see backward._launch_parameters:
    programs that own fewer than 128 rows take at most 2 stages)."""
    return min(stages, 2) if owned_rows < 128 else stages


def backward_options_bytes(options: KernelOptions, *, dtype, head_dim: int, value_dim: int,
                           mask_block: tuple[int, int], reads: ModReads) -> int:
    dq_tile = (min(options.backward_block_q, mask_block[0]),
               min(options.backward_block_kv, mask_block[1]))
    dkdv_tile = (min(options.backward_dkdv_block_q, mask_block[0]),
                 min(options.backward_dkdv_block_kv, mask_block[1]))
    stages = options.backward_num_stages
    dkdv_stages = options.backward_dkdv_num_stages or stages
    return backward_bytes(
        dtype=dtype, head_dim=head_dim, value_dim=value_dim, dq_tile=dq_tile,
        dkdv_tile=dkdv_tile,
        dq_stages=effective_backward_stages(stages, min(dq_tile[0], dkdv_tile[1])),
        dkdv_stages=effective_backward_stages(dkdv_stages, dkdv_tile[1]), reads=reads)


def forward_options_bytes(options: KernelOptions, *, dtype, head_dim: int, value_dim: int,
                          mask_block: tuple[int, int], reads: ModReads,
                          num_stages=None) -> int:
    return forward_bytes(dtype=dtype, head_dim=head_dim, value_dim=value_dim,
                         block_q=min(options.block_q, mask_block[0]),
                         block_kv=min(options.block_kv, mask_block[1]),
                         num_stages=num_stages or options.num_stages, reads=reads)


# The order in which a configuration gives up shared memory: pipelining depth first
# (down to double buffering), then the streamed tiles, then the held ones, then
# single buffering, then everything down to the 16-row tensor-core minimum.
_FORWARD_STEPS = (("num_stages", 2), ("block_kv", 32), ("block_q", 64), ("num_stages", 1),
                  ("block_kv", 16), ("block_q", 16))
_BACKWARD_STEPS = (("backward_num_stages", 2), ("backward_dkdv_num_stages", 2),
                   ("backward_block_kv", 64), ("backward_dkdv_block_q", 64),
                   ("backward_block_kv", 32), ("backward_dkdv_block_q", 32),
                   ("backward_block_q", 64), ("backward_dkdv_block_kv", 64),
                   ("backward_block_q", 32), ("backward_dkdv_block_kv", 32),
                   ("backward_num_stages", 1), ("backward_dkdv_num_stages", 1),
                   ("backward_block_kv", 16), ("backward_dkdv_block_q", 16),
                   ("backward_block_q", 16), ("backward_dkdv_block_kv", 16))
# Options of each kernel whose values set its shared memory (named in errors).
FORWARD_FIELDS = ("block_q", "block_kv", "num_stages")
BACKWARD_FIELDS = ("backward_block_q", "backward_block_kv", "backward_dkdv_block_q",
                   "backward_dkdv_block_kv", "backward_num_stages", "backward_dkdv_num_stages")


def _shrink_step(options: KernelOptions, field: str, floor: int):
    value = getattr(options, field)
    if field in options.given or value == 0 or value <= floor:
        return None
    if field.endswith("stages"):
        return options.replace(**{field: value - 1})
    return options.replace(**{field: max(floor, value // 2)})


def fit(options: KernelOptions, estimate, budget: int, *, kernel: str,
        inputs: str = "these inputs") -> KernelOptions:
    """`options` with the fields the user did not set shrunk until `estimate(options)`
    fits `budget` bytes; a ValueError naming the user's settings if it cannot, or, when
    even the smallest tiles do not fit, what cannot run (`inputs`: their dtype and head
    dim, e.g. "float32 inputs at head dim 256") and what can."""
    steps = _FORWARD_STEPS if kernel == "forward" else _BACKWARD_STEPS
    fields = FORWARD_FIELDS if kernel == "forward" else BACKWARD_FIELDS
    while estimate(options) > budget:
        for field, floor in steps:
            shrunk = _shrink_step(options, field, floor)
            if shrunk is not None:
                options = shrunk
                break
        else:
            given = {field: getattr(options, field) for field in fields
                     if field in options.given}
            raise ValueError(
                f"kernel_options {given} need about {estimate(options) // 1024} KiB of shared "
                f"memory in the {kernel} kernel, more than the {budget // 1024} KiB this GPU "
                "has (PALLAS_FLEX_SHARED_MEMORY_KIB sets the budget): give smaller tiles or "
                "fewer stages, or leave them to the defaults" if given else
                f"no {kernel} kernel configuration fits {budget // 1024} KiB of shared memory "
                f"(the smallest needs {estimate(options) // 1024} KiB): {inputs} cannot run "
                "on a GPU with this budget; use bfloat16 or float16 inputs, or a smaller "
                "head dim")
    return options


def fit_streaming(block_kv: int, num_stages: int, estimate, budget: int, *, kernel: str,
                  block_kv_given: bool = False, stages_given: bool = False):
    """(block_kv, num_stages) of a kernel that holds a query tile and streams K/V tiles
    (decode, ragged), fitted to `budget` bytes of `estimate(block_kv, num_stages)`:
    stages first (down to 2), then the KV tile (down to 16 rows), then single
    buffering; values the user gave are kept (a ValueError if they cannot fit)."""
    while estimate(block_kv, num_stages) > budget:
        if num_stages > 2 and not stages_given:
            num_stages -= 1
        elif block_kv > 16 and not block_kv_given:
            block_kv //= 2
        elif num_stages > 1 and not stages_given:
            num_stages -= 1
        else:
            raise ValueError(
                f"the {kernel} kernel with {block_kv}-row KV tiles and {num_stages} stages "
                f"needs about {estimate(block_kv, num_stages) // 1024} KiB of shared memory, "
                f"more than the {budget // 1024} KiB this GPU has "
                "(PALLAS_FLEX_SHARED_MEMORY_KIB sets the budget): give smaller kernel_options "
                "or leave them to the defaults")
    return block_kv, num_stages
