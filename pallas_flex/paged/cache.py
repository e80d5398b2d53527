"""PagedKVCache: a KV cache in fixed-size pages, with a page table per batch row.

Every field is an array (a pytree leaf), and every configuration number is read off
the arrays' shapes, so a cache passes through `jax.jit`, `lax.scan` and buffer donation
like any other pytree. The free-page bookkeeping is an array too (`page_owner`), so
`reserve` and `erase` run inside `jit` with traced row indices and lengths.

Checks on values (out of pages, an empty slot, writing past a reservation, a row out of
range, and `validate`'s: page-table entries in the pool, lengths within the reserved
pages) raise `ValueError` when the values are concrete (eager calls). Inside `jit` they
are `checkify.debug_check`s: free under a plain `jit`, reported by
`jax.experimental.checkify.checkify(fn)`. An unchecked bad call under `jit` changes
nothing (for `assign_batch`: nothing in the offending rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flex.kernels import device
from pallas_flex.paged._validation import (
    as_index_scalar, as_index_vector, checking_arrays, first_true, require)
from pallas_flex.paged.quantize import dequantize, is_quantized, quantize



def _ceil_div(a, b):
    return (a + b - 1) // b


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_pages", "v_pages", "page_table", "lengths", "page_owner", "k_scales",
                 "v_scales"],
    meta_fields=["latent_value_dim"])
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Keys and values in pages, addressed through a per-row page table.

    Fields (all arrays; pytree leaves):
      k_pages    [num_pages, Hkv, page_size, D]   key pages
      v_pages    [num_pages, Hkv, page_size, Dv]  value pages; None in a latent cache
      page_table int32 [max_batch, max_pages_per_seq]: the physical pages of each row in
                 logical order, -1 = none. A row's pages always fill a prefix of its
                 table row, so logical position `p` of row `b` lives in page
                 `page_table[b, p // page_size]` at offset `p % page_size`.
      lengths    int32 [max_batch]: tokens stored in each row (positions 0..lengths-1).
      page_owner int32 [num_pages]: the row holding each page, -1 = free.
      k_scales, v_scales  float32 [num_pages, Hkv, page_size], for int8 / float8_e4m3fn
                 pages (`create(dtype=jnp.int8)`): one scale per stored token and head
                 (`pallas_flex.paged.quantize`); None for 16/32-bit pages.
      latent_value_dim  (static) 0, or Dv for a latent cache (`create(latent=True)`,
                 DeepSeek's MLA): the values are the key pages' first Dv columns, stored
                 once; `assign` takes k alone, and the latent decode reads the values
                 from the key pages in place.

    Methods return a new cache; under `jax.jit(..., donate_argnums=...)` the page
    updates are scatters done in place.

    Example:
      >>> cache = PagedKVCache.create(num_pages=64, page_size=16, max_batch=4,
      ...                             max_pages_per_seq=8, kv_heads=2, head_dim=64)
      >>> cache = cache.reserve(0, 20)              # row 0: pages for 20 tokens
      >>> cache = cache.assign(0, 0, k, v)          # k [20, 2, 64], v [20, 2, 64]
      >>> k_all, v_all = gather_contiguous(cache)   # [4, 128, 2, 64] each
    """

    k_pages: jax.Array
    v_pages: jax.Array | None
    page_table: jax.Array
    lengths: jax.Array
    page_owner: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None
    latent_value_dim: int = 0

    @classmethod
    def create(cls, num_pages: int, page_size: int, max_batch: int, max_pages_per_seq: int,
               kv_heads: int, head_dim: int, value_dim: int | None = None,
               dtype=jnp.bfloat16, latent: bool = False) -> "PagedKVCache":
        """An empty cache: zero pages, all free; every row empty. dtype: the pages'
        (float32, bfloat16, float16), or int8 / float8_e4m3fn for a quantized cache
        (tokens written in 16 or 32 bits are quantized per token and head). latent: the
        values are the keys' first value_dim columns (DeepSeek's MLA cache, e.g.
        head_dim 576, value_dim 512): key pages only."""
        value_dim = head_dim if value_dim is None else value_dim
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("max_batch", max_batch), ("max_pages_per_seq", max_pages_per_seq),
                            ("kv_heads", kv_heads), ("head_dim", head_dim),
                            ("value_dim", value_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive Python int, got {value!r}")
        if jnp.dtype(dtype) not in device.SUPPORTED_DTYPES and not is_quantized(dtype):
            raise ValueError(f"dtype must be float32, bfloat16, float16, int8 or "
                             f"float8_e4m3fn, got {jnp.dtype(dtype)}")
        if latent and value_dim > head_dim:
            raise ValueError(f"a latent cache's values are its keys' first value_dim "
                             f"columns: value_dim ({value_dim}) must be at most head_dim "
                             f"({head_dim})")
        if latent and is_quantized(dtype):
            raise ValueError("a latent cache takes 16- or 32-bit pages, not "
                             f"{jnp.dtype(dtype)}")
        scales = (jnp.ones((num_pages, kv_heads, page_size), jnp.float32)
                  if is_quantized(dtype) else None)
        return cls(
            k_pages=jnp.zeros((num_pages, kv_heads, page_size, head_dim), dtype),
            v_pages=(None if latent else
                     jnp.zeros((num_pages, kv_heads, page_size, value_dim), dtype)),
            page_table=jnp.full((max_batch, max_pages_per_seq), -1, jnp.int32),
            lengths=jnp.zeros((max_batch,), jnp.int32),
            page_owner=jnp.full((num_pages,), -1, jnp.int32),
            k_scales=scales, v_scales=scales, latent_value_dim=value_dim if latent else 0)

    # -- configuration, from the shapes ---------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]

    @property
    def value_dim(self) -> int:
        return self.latent_value_dim or self.v_pages.shape[3]

    @property
    def latent(self) -> bool:
        """Whether the values are the key pages' first `value_dim` columns."""
        return bool(self.latent_value_dim)

    def value_pages(self):
        """[num_pages, Hkv, page_size, Dv]: v_pages, or a latent cache's key pages' first
        Dv columns (a slice: a copy wherever it is used)."""
        return self.k_pages[..., :self.latent_value_dim] if self.latent else self.v_pages

    @property
    def dtype(self):
        return self.k_pages.dtype

    @property
    def quantized(self) -> bool:
        """Whether the pages hold int8 / float8 values with per-token scales."""
        return self.k_scales is not None

    @property
    def max_batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.max_pages_per_seq * self.page_size

    @property
    def reserved_pages(self) -> jax.Array:
        """int32 [max_batch]: pages held by each row."""
        return jnp.sum(self.page_table >= 0, axis=1, dtype=jnp.int32)

    @property
    def num_free_pages(self) -> jax.Array:
        """int32 scalar: pages no row holds."""
        return jnp.sum(self.page_owner < 0, dtype=jnp.int32)

    # -- validation -------------------------------------------------------------------

    def validate(self) -> "PagedKVCache":
        """Checks the page table and the lengths; returns the cache.

        Rules (what `reserve`/`erase`/`assign` maintain, and what a hand-built cache must
        obey): every `page_table` entry is -1 or a page of the pool, `[0, num_pages)`;
        each row's pages fill a prefix of its table row (no page after a -1); and
        `lengths[b]` is in `[0, pages reserved by row b * page_size]`. Concrete values:
        a `ValueError` naming the row, the entry and the pool size. Traced (under
        `jit`): `checkify.debug_check`s with the same messages (see
        `pallas_flex.paged.traced_checks`). `paged_flex_attention` and the methods that
        read the page table (`reserve`, `assign`, `assign_batch`) call it.
        """
        xp, (table, lengths) = checking_arrays(self.page_table, self.lengths)
        check_page_table(xp, table, lengths, num_pages=self.num_pages,
                         page_size=self.page_size)
        return self

    # -- page bookkeeping -------------------------------------------------------------

    def _check_batch_index(self, xp, batch_idx):
        require((batch_idx >= 0) & (batch_idx < self.max_batch),
                f"batch_idx must be in [0, {self.max_batch}) (max_batch), got {{batch_idx}}",
                batch_idx=batch_idx)
        return xp.clip(batch_idx, 0, self.max_batch - 1)

    def reserve(self, batch_idx, seq_len) -> "PagedKVCache":
        """Makes row `batch_idx` hold pages for `seq_len` tokens in all.

        Pages the row already holds are kept (a reservation never shrinks); the missing
        ones are the lowest-numbered free pages, appended in ascending order. Contents
        and `lengths` are untouched. `batch_idx`, `seq_len`: ints or int32 scalars,
        traced or not.
        """
        batch_idx = as_index_scalar(batch_idx, "batch_idx")
        seq_len = as_index_scalar(seq_len, "seq_len")
        self.validate()
        xp, (b, n, table, owner) = checking_arrays(batch_idx, seq_len, self.page_table,
                                                   self.page_owner)
        row = self._check_batch_index(xp, b)
        require((n >= 0) & (n <= self.max_seq_len),
                f"seq_len must be in [0, {self.max_seq_len}] (max_pages_per_seq * "
                f"page_size = {self.max_pages_per_seq} * {self.page_size}), got {{seq_len}}",
                seq_len=n)
        missing = xp.maximum(_ceil_div(n, self.page_size) - xp.sum(table[row] >= 0), 0)
        free = xp.sum(owner < 0)
        require(missing <= free,
                "out of pages: row {batch_idx} needs {missing} more pages for {seq_len} "
                "tokens but only {free} are free",
                batch_idx=b, missing=missing, seq_len=n, free=free)
        return _reserve(self, batch_idx, seq_len)

    def erase(self, batch_idx) -> "PagedKVCache":
        """Frees row `batch_idx`'s pages, empties its table row and sets its length to 0.

        Erasing a row that holds no pages is an error. Page contents are left as they
        are (the next `assign` overwrites them).
        """
        batch_idx = as_index_scalar(batch_idx, "batch_idx")
        xp, (b, table) = checking_arrays(batch_idx, self.page_table)
        row = self._check_batch_index(xp, b)
        require(xp.any(table[row] >= 0),
                "cannot erase row {batch_idx}: it holds no pages (an empty slot)",
                batch_idx=b)
        return _erase(self, batch_idx)

    # -- writing tokens -----------------------------------------------------------------

    def _check_tokens(self, k, v, leading: tuple[int, ...]):
        """Shapes [*leading, S, Hkv, D] / [..., Dv] and the cache's dtype; returns S. A
        latent cache takes k alone (v None: its values are k's first Dv columns)."""
        rank = len(leading) + 3
        if self.latent:
            if v is not None:
                raise ValueError("a latent cache stores its values as the keys' first "
                                 f"{self.value_dim} columns: pass v=None")
            v = k
        elif v is None:
            raise ValueError("v is None: only a latent cache (create(latent=True)) takes "
                             "k alone")
        for name, x, dim, dim_name, pages in (
                ("k", k, self.head_dim, "D", self.k_pages),
                ("v", v, self.head_dim if self.latent else self.value_dim, "Dv",
                 self.k_pages if self.latent else self.v_pages)):
            if not hasattr(x, "shape") or len(x.shape) != rank:
                layout = ", ".join(["B"] * len(leading) + ["S", "Hkv", dim_name])
                raise ValueError(f"{name} must be a {rank}-D array [{layout}], got shape "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
            expected = (*leading, x.shape[len(leading)], self.kv_heads, dim)
            if tuple(x.shape) != expected:
                raise ValueError(f"{name} must have shape {expected} (the cache has "
                                 f"{self.kv_heads} kv heads of dim {dim}), got {tuple(x.shape)}")
            if self.quantized and x.dtype not in device.SUPPORTED_DTYPES:
                raise ValueError(f"{name} must be float32, bfloat16 or float16 (quantized "
                                 f"to the cache's {pages.dtype} when written), got {x.dtype}")
            if not self.quantized and x.dtype != pages.dtype:
                raise ValueError(f"{name} must have the cache's dtype {pages.dtype}, got "
                                 f"{x.dtype}")
        if k.shape[len(leading)] != v.shape[len(leading)]:
            raise ValueError(f"k and v must hold the same number of tokens, "
                             f"got {k.shape[len(leading)]} and {v.shape[len(leading)]}")
        return k.shape[len(leading)]

    def assign(self, batch_idx, input_pos, k, v=None) -> "PagedKVCache":
        """Writes `S` new tokens at positions `input_pos .. input_pos + S - 1` of a row.

        Args:
          batch_idx, input_pos: ints or int32 scalars (traced or not). `input_pos` may
            rewrite stored positions but must not leave a gap: `input_pos <=
            lengths[batch_idx]`, and `input_pos + S` must fit in the row's reserved pages.
          k: [S, Hkv, D]; v: [S, Hkv, Dv], in the cache's dtype (a latent cache: v None,
            the values being k's first Dv columns).
        Returns:
          The cache with the tokens scattered into their pages (one scatter each for k
          and v) and `lengths[batch_idx] = max(lengths[batch_idx], input_pos + S)`.
        """
        num_tokens = self._check_tokens(k, v, ())
        batch_idx = as_index_scalar(batch_idx, "batch_idx")
        input_pos = as_index_scalar(input_pos, "input_pos")
        self.validate()
        xp, (b, start, table, lengths) = checking_arrays(batch_idx, input_pos,
                                                         self.page_table, self.lengths)
        row = self._check_batch_index(xp, b)
        self._check_writes(xp, b, start, start + num_tokens, lengths[row],
                           xp.sum(table[row] >= 0) * self.page_size)
        return _assign(self, batch_idx, input_pos, k, v)

    def assign_batch(self, input_pos, k, v=None, num_tokens=None) -> "PagedKVCache":
        """`assign` for every row at once (one scatter each for k and v).

        Args:
          input_pos: int32 [max_batch], where each row's new tokens start.
          k: [max_batch, S, Hkv, D]; v: [max_batch, S, Hkv, Dv], in the cache's dtype
            (a latent cache: v None).
          num_tokens: int32 [max_batch] in [0, S], how many of its S tokens row b writes
            (the first ones; the rest are padding); None = all S. Rows with 0 tokens
            (e.g. free slots during a decode step) are left untouched and unchecked.
        Returns:
          The cache where row b holds `k[b, :num_tokens[b]]` at positions
          `input_pos[b] ..`, and `lengths[b] = max(lengths[b], input_pos[b] +
          num_tokens[b])` for the rows that wrote. Each writing row obeys `assign`'s
          rules (no gap past `lengths[b]`, within its reserved pages).
        """
        seq = self._check_tokens(k, v, (self.max_batch,))
        input_pos = as_index_vector(input_pos, "input_pos", self.max_batch)
        if num_tokens is None:
            num_tokens = np.full((self.max_batch,), seq, np.int32)
        num_tokens = as_index_vector(num_tokens, "num_tokens", self.max_batch)
        self.validate()
        xp, (start, count, table, lengths) = checking_arrays(input_pos, num_tokens,
                                                             self.page_table, self.lengths)
        bad = (count < 0) | (count > seq)
        row = first_true(bad)
        require(~xp.any(bad), f"num_tokens must be in [0, {seq}] (k.shape[1]); "
                "num_tokens[{row}] = {value}", row=row, value=count[row])
        self._check_writes(xp, xp.arange(self.max_batch), start, start + count, lengths,
                           xp.sum(table >= 0, axis=1) * self.page_size, active=count > 0)
        return _assign_batch(self, input_pos, k, v, num_tokens)

    @staticmethod
    def _check_writes(xp, batch_idx, start, end, length, capacity, active=True):
        """Writes [start, end) to rows batch_idx: start >= 0, no gap (start <= length),
        end <= capacity; only where `active`. Scalars or [max_batch] arrays."""
        checks = (
            (start < 0, "input_pos must be >= 0, got {start} for row {row}"),
            (start > length, "input_pos {start} would leave a gap in row {row}, which "
                             "holds {length} tokens (input_pos must be <= lengths[row])"),
            (end > capacity, "writing up to position {end} of row {row} needs a "
                             "reservation, but the row's pages hold {capacity} tokens "
                             "(call reserve first)"),
        )
        for failing, message in checks:
            failing = xp.atleast_1d(failing & active)
            index = first_true(failing)

            def pick(x):
                return xp.atleast_1d(x)[xp.minimum(index, xp.size(x) - 1)]

            require(~xp.any(failing), message, row=pick(batch_idx), start=pick(start),
                    end=pick(end), length=pick(length), capacity=pick(capacity))


def check_page_table(xp, page_table, lengths, *, num_pages: int, page_size: int) -> None:
    """`PagedKVCache.validate`'s checks on `page_table [B, P]` and `lengths [B]` (NumPy
    arrays, or jnp arrays when traced: `require`s either way)."""
    max_pages = page_table.shape[1]
    if page_table.size == 0:
        return
    bad = (page_table < -1) | (page_table >= num_pages)
    flat = first_true(bad.reshape(-1))
    row, entry = flat // max_pages, flat % max_pages
    require(~xp.any(bad),
            "page_table[{row}, {entry}] = {value} is out of range: page table entries must "
            f"be -1 (no page) or a page of the pool, in [0, {num_pages}) (num_pages)",
            row=row, entry=entry, value=page_table.reshape(-1)[flat])
    present = page_table >= 0
    # A row's pages fill a prefix of its table row: no page after an empty (-1) entry.
    hole = present[:, 1:] & ~present[:, :-1]
    flat = first_true(hole.reshape(-1))
    row, entry = flat // max(max_pages - 1, 1), flat % max(max_pages - 1, 1) + 1
    require(~xp.any(hole),
            "page_table[{row}, {entry}] = {value} follows an empty entry (-1) in row {row}: "
            "a row's pages must fill a prefix of its table row",
            row=row, entry=entry, value=page_table[row, xp.minimum(entry, max_pages - 1)])
    # Pages reserved: the prefix of non-negative entries (all of them once the check
    # above passes).
    reserved = xp.sum(xp.cumprod(present.astype(np.int32), axis=1), axis=1)
    capacity = reserved * page_size
    bad = (lengths < 0) | (lengths > capacity)
    row = first_true(bad)
    require(~xp.any(bad),
            "lengths[{row}] = {length} is out of range: row {row} has {pages} pages "
            f"reserved, so its length must be in [0, {{capacity}}] (pages * page_size "
            f"{page_size})",
            row=row, length=lengths[row], pages=reserved[row], capacity=capacity[row])


# The updates, one compiled program each (eager calls dispatch once; under an outer
# `jit` they inline). They recompute the validity of their arguments and do nothing
# where the checks above would fail: an unchecked bad call under `jit` leaves the cache
# (or, for assign_batch, the offending row) unchanged rather than half-updated.


def _row_target(cache, batch_idx):
    """batch_idx, or max_batch (dropped by a scatter) when out of range: a negative
    index must not wrap around to another row."""
    in_range = (batch_idx >= 0) & (batch_idx < cache.max_batch)
    return jnp.where(in_range, batch_idx, cache.max_batch)


@jax.jit
def _reserve(cache: PagedKVCache, batch_idx, seq_len) -> PagedKVCache:
    target = _row_target(cache, batch_idx)
    row = cache.page_table[jnp.clip(batch_idx, 0, cache.max_batch - 1)]
    held = jnp.sum(row >= 0, dtype=jnp.int32)
    wanted = _ceil_div(seq_len, cache.page_size)
    valid = ((target < cache.max_batch) & (seq_len >= 0) & (seq_len <= cache.max_seq_len)
             & (wanted - held <= cache.num_free_pages))
    # The lowest free pages; `num_pages` pads the list when fewer are free.
    (free_pages,) = jnp.nonzero(cache.page_owner < 0, size=cache.max_pages_per_seq,
                                fill_value=cache.num_pages)
    slots = jnp.arange(cache.max_pages_per_seq, dtype=jnp.int32)
    candidates = free_pages[jnp.clip(slots - held, 0, cache.max_pages_per_seq - 1)]
    new = (slots >= held) & (slots < wanted) & valid
    page_table = cache.page_table.at[target].set(jnp.where(new, candidates, row), mode="drop")
    page_owner = cache.page_owner.at[jnp.where(new, candidates, cache.num_pages)].set(
        batch_idx, mode="drop")
    return dataclasses.replace(cache, page_table=page_table, page_owner=page_owner)


@jax.jit
def _erase(cache: PagedKVCache, batch_idx) -> PagedKVCache:
    target = _row_target(cache, batch_idx)
    return dataclasses.replace(
        cache,
        page_owner=jnp.where(cache.page_owner == target, -1, cache.page_owner),
        page_table=cache.page_table.at[target].set(-1, mode="drop"),
        lengths=cache.lengths.at[target].set(0, mode="drop"))


def _writes(cache, rows, input_pos, num_tokens, steps):
    """Targets of writing tokens `steps` (< num_tokens) at input_pos.. of `rows` (all
    broadcast together): (page, offset, valid row). Invalid rows' tokens, like padding,
    get page `num_pages`, which the scatter drops."""
    target = _row_target(cache, rows)
    row = jnp.clip(rows, 0, cache.max_batch - 1)
    capacity = jnp.sum(cache.page_table[row] >= 0, axis=-1) * cache.page_size
    valid = ((target < cache.max_batch) & (input_pos >= 0) & (input_pos <= cache.lengths[row])
             & (input_pos + num_tokens <= capacity) & (num_tokens >= 0)
             & (num_tokens <= steps.shape[-1]))
    positions = input_pos[..., None] + steps
    logical_page = jnp.clip(positions // cache.page_size, 0, cache.max_pages_per_seq - 1)
    page = cache.page_table[row[..., None], logical_page]
    write = valid[..., None] & (steps < num_tokens[..., None])
    return jnp.where(write, page, cache.num_pages), positions % cache.page_size, valid


def _write(cache, page, offset, k, v):
    """The cache's page (and scale) arrays with k, v written; a quantized cache quantizes
    them per token and head first."""
    # Indices (page, :, offset) put the token axes first: updates are [..., S, Hkv, D].
    if cache.latent:
        return dict(k_pages=cache.k_pages.at[page, :, offset].set(k, mode="drop"))
    if not cache.quantized:
        return dict(k_pages=cache.k_pages.at[page, :, offset].set(k, mode="drop"),
                    v_pages=cache.v_pages.at[page, :, offset].set(v, mode="drop"))
    (k, k_scales), (v, v_scales) = (quantize(x, cache.dtype) for x in (k, v))
    return dict(k_pages=cache.k_pages.at[page, :, offset].set(k, mode="drop"),
                v_pages=cache.v_pages.at[page, :, offset].set(v, mode="drop"),
                k_scales=cache.k_scales.at[page, :, offset].set(k_scales, mode="drop"),
                v_scales=cache.v_scales.at[page, :, offset].set(v_scales, mode="drop"))


@jax.jit
def _assign(cache: PagedKVCache, batch_idx, input_pos, k, v) -> PagedKVCache:
    num_tokens = jnp.int32(k.shape[0])
    page, offset, valid = _writes(cache, batch_idx, input_pos, num_tokens,
                                  jnp.arange(k.shape[0], dtype=jnp.int32))
    written = _write(cache, page, offset, k, v)
    target = jnp.where(valid, batch_idx, cache.max_batch)
    return dataclasses.replace(
        cache, **written,
        lengths=cache.lengths.at[target].max(input_pos + num_tokens, mode="drop"))


@jax.jit
def _assign_batch(cache: PagedKVCache, input_pos, k, v, num_tokens) -> PagedKVCache:
    rows = jnp.arange(cache.max_batch, dtype=jnp.int32)
    page, offset, valid = _writes(cache, rows, input_pos, num_tokens,
                                  jnp.arange(k.shape[1], dtype=jnp.int32))
    written = _write(cache, page, offset, k, v)
    lengths = jnp.where(valid & (num_tokens > 0),
                        jnp.maximum(cache.lengths, input_pos + num_tokens), cache.lengths)
    return dataclasses.replace(cache, **written, lengths=lengths)


def gather_contiguous(cache: PagedKVCache) -> tuple[jax.Array, jax.Array]:
    """Every row's tokens in logical order, for tests and references.

    Returns (k [max_batch, max_seq_len, Hkv, D], v [max_batch, max_seq_len, Hkv, Dv]),
    zero at positions >= lengths[b]; a quantized cache's dequantized, in float32.
    Allocates the whole logical cache: O(max_batch * max_seq_len) memory, not for use on
    a hot path.
    """
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    return _gather_contiguous(cache.validate())


@jax.jit
def _gather_contiguous(cache: PagedKVCache) -> tuple[jax.Array, jax.Array]:
    stored = (jnp.arange(cache.max_seq_len, dtype=jnp.int32)[None, :]
              < cache.lengths[:, None])  # [B, max_seq_len]

    def gather(pages, scales):
        if scales is not None:
            pages = dequantize(pages, scales)
        rows = pages[jnp.maximum(cache.page_table, 0)]  # [B, P, Hkv, page_size, D]
        rows = jnp.swapaxes(rows, 2, 3).reshape(
            cache.max_batch, cache.max_seq_len, pages.shape[1], pages.shape[3])
        return jnp.where(stored[:, :, None, None], rows, jnp.zeros((), pages.dtype))

    keys = gather(cache.k_pages, cache.k_scales)
    if cache.latent:
        return keys, keys[..., :cache.value_dim]
    return keys, gather(cache.v_pages, cache.v_scales)
