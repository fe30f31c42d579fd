"""Static-shape KV cache with per-row lengths.

Row b holds `lengths[b]` valid entries; a forward of T tokens writes K/V at positions
`lengths[b] .. lengths[b] + T - 1` and leaves `lengths` unchanged: the caller commits what it keeps
with `advance` (the speculative loop commits `num_accepted + 1` of K + 1 written entries). Entries
at or beyond `lengths[b]` are invisible to later queries and get overwritten.

`window` (static, 0 = the whole cache) bounds what attention reads: queries see only positions
< window, so a decode step over short rows reads a prefix of the buffers, not all of them. The
caller keeps every live row's writes inside the window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # per layer [B, S, Hkv, Dh]
  v: tuple[jax.Array, ...]
  lengths: jax.Array  # int32[B]
  window: int = struct.field(pytree_node=False, default=0)  # positions attention reads; 0 = all

  @classmethod
  def create(cls, num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> "KVCache":
    shape = (batch, size, num_kv_heads, head_dim)
    return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
               v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def size(self) -> int:
    return self.k[0].shape[1]

  @property
  def visible(self) -> int:
    """How many leading positions attention reads."""
    return min(self.window, self.size) if self.window else self.size

  def with_window(self, window: int) -> "KVCache":
    return self.replace(window=int(window))

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  def advance(self, n: jax.Array) -> "KVCache":
    """Commit `n[b]` freshly written entries of row b."""
    return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """buf[b, start[b] : start[b] + T] = new[b] for every row b (buf [B, S, ...], new [B, T, ...])."""

  def one(row, upd, s):
    idx = (s,) + (0,) * (row.ndim - 1)
    return jax.lax.dynamic_update_slice(row, upd.astype(row.dtype), idx)

  return jax.vmap(one)(buf, new, start)
