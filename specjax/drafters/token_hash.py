"""One hash of a run of token ids, computed the same on the device and on the host.

The history store finds a prompt's entries by it and the cross-prompt table finds an n-gram's
continuation by it; the drafters compute it on the device for the rows they draft.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_MULT = np.uint32(0x9E3779B1)  # odd: multiplication is a bijection mod 2^32
_SEED = np.uint32(0x85EBCA6B)


def prompt_keys(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """uint32[B]: a hash of each row's first lengths[b] tokens (the same as `prompt_key`)."""
  width = tokens.shape[1]
  powers = jnp.cumprod(jnp.full((width,), _MULT, jnp.uint32)) * _SEED  # mod 2^32
  live = jnp.arange(width)[None, :] < lengths[:, None]
  terms = jnp.where(live, (tokens.astype(jnp.uint32) + jnp.uint32(1)) * powers[None, :], 0)
  return jnp.sum(terms, axis=1, dtype=jnp.uint32) + lengths.astype(jnp.uint32)


def window_keys(windows) -> np.ndarray:
  """uint32[N]: the hash `prompt_keys` computes on the device, of each row of windows int[N, n]
  (all n tokens), on the host."""
  w = np.asarray(windows, np.uint32)
  n = w.shape[1]
  with np.errstate(over="ignore"):
    powers = np.cumprod(np.full((n,), _MULT, np.uint32), dtype=np.uint32) * _SEED
    return np.sum((w + np.uint32(1)) * powers[None, :], axis=1, dtype=np.uint32) + np.uint32(n)


def prompt_key(tokens) -> int:
  """`window_keys` of one prompt's token ids."""
  return int(window_keys(np.asarray(tokens)[None, :])[0])
