"""Paged serving: a paged KV cache and attention over pages.

* `PagedKVCache` — pages, page table, lengths and free-page bookkeeping as one pytree;
  `reserve`, `erase`, `assign`, `assign_batch` return a new cache (in place under
  `jit` with donation). `gather_contiguous` reads it back in logical order.
* `paged_attention` — the ragged mixed prefill + decode op (OpenVINO PagedAttention):
  token-major new tokens of many sequences, written into the cache and attending to
  their paged history. `score_offsets` locates each sequence in its scores.
* `paged_flex_attention` — any BlockMask and mods over a `PagedKVCache`, the pages read
  in place by the decode and forward kernels (mods see logical positions).
* `traced_checks(False)` — leaves the metadata checks out of functions traced inside it
  (they are `checkify.debug_check`s by default, which slow a jitted call's dispatch).
"""

from pallas_flex.paged._validation import set_traced_checks, traced_checks
from pallas_flex.paged.cache import PagedKVCache, gather_contiguous
from pallas_flex.paged.flex_attention import paged_flex_attention
from pallas_flex.paged.ragged import paged_attention, score_offsets

__all__ = ["PagedKVCache", "gather_contiguous", "paged_attention", "paged_flex_attention",
           "score_offsets", "set_traced_checks", "traced_checks"]
