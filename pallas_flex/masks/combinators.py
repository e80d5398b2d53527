"""Combinators: build a mask_mod out of other mask_mods, and the identity mods.

Each combinator returns an ordinary mask_mod, so results nest freely:

    >>> from pallas_flex.masks.causal import causal_mask
    >>> from pallas_flex.masks.sliding_window import sliding_window
    >>> local_causal = and_masks(causal_mask, sliding_window(4, causal=False))
    >>> local_causal.__name__
    'and_masks(causal_mask, sliding_window_4_bidirectional)'
    >>> bool(local_causal(0, 0, 5, 2)), bool(local_causal(0, 0, 5, 1))
    (True, False)
"""

import functools
import operator

import jax.numpy as jnp


def _mod_name(mod):
    return getattr(mod, "__name__", repr(mod))


def _check_callables(function_name, mask_mods):
    for position, mask_mod in enumerate(mask_mods):
        if not callable(mask_mod):
            raise ValueError(
                f"{function_name}: mask_mods[{position}] must be a callable "
                f"mask_mod(b, h, q_idx, kv_idx) -> bool, got {mask_mod!r}"
            )


def noop_mask(b, h, q_idx, kv_idx):
    """The mask_mod that keeps every score: a bool scalar True."""
    return jnp.bool_(True)


def noop_score(score, b, h, q_idx, kv_idx):
    """The score_mod that leaves every score as it is."""
    return score


def _combine(function_name, mask_mods, combine, empty):
    """A mask_mod folding `mask_mods` with `combine`; `empty` when there are none."""
    _check_callables(function_name, mask_mods)

    def combined(b, h, q_idx, kv_idx):
        if not mask_mods:
            return jnp.bool_(empty)
        results = [mask_mod(b, h, q_idx, kv_idx) for mask_mod in mask_mods]
        return functools.reduce(combine, results)

    combined.__name__ = f"{function_name}({', '.join(map(_mod_name, mask_mods))})"
    return combined


def and_masks(*mask_mods):
    """A mask_mod that is True where every one of `mask_mods` is True.

    With no arguments it is True everywhere, like PyTorch's `and_masks()`.
    """
    return _combine("and_masks", mask_mods, operator.and_, True)


def or_masks(*mask_mods):
    """A mask_mod that is True where at least one of `mask_mods` is True.

    With no arguments it is False everywhere, like PyTorch's `or_masks()`.
    """
    return _combine("or_masks", mask_mods, operator.or_, False)


def not_mask(mask_mod):
    """A mask_mod that is True exactly where `mask_mod` is False."""
    if not callable(mask_mod):
        raise ValueError(
            "not_mask: mask_mod must be a callable mask_mod(b, h, q_idx, kv_idx) -> bool, "
            f"got {mask_mod!r}"
        )

    def inverted_mask(b, h, q_idx, kv_idx):
        return ~mask_mod(b, h, q_idx, kv_idx)

    inverted_mask.__name__ = f"not_mask({_mod_name(mask_mod)})"
    return inverted_mask
