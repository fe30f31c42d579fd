"""Static-shape KV cache with per-row lengths.

Row b holds `lengths[b]` valid entries; a forward of T tokens writes K/V at positions
`lengths[b] .. lengths[b] + T - 1` and leaves `lengths` unchanged: the caller commits what it keeps
with `advance` (the speculative loop commits `num_accepted + 1` of K + 1 written entries). Entries
at or beyond `lengths[b]` are invisible to later queries and get overwritten.

`window` (static, 0 = the whole cache) bounds what attention reads: queries see only positions
< window, so a decode step over short rows reads a prefix of the buffers, not all of them. The
caller keeps every live row's writes inside the window.

Layout: keys per layer [B, Hkv, Dh, S], values [B, Hkv, S, Dh]. Those are the operand layouts of
attention's two products (q . k over Dh, probs . v over S), so a decode step reads the buffers as
they are; stored [B, S, Hkv, Dh], XLA copied every layer's whole cache into these layouts at
every step (on the 2-core CPU this layout made AR steps of a 14.2M policy over 176 cache
positions 1.15x faster at 8 rows and 1.36x at 32; docs/BENCHMARKS.md, "KV-cache layout").
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from flax import struct


# Cache positions a cached forward's attention reads at a time (`layers.attend_cache`,
# `paged_attention.paged_attention_chunked`), and the smallest key buffer (bytes per layer, as read) it
# reads in chunks. Reading only the live part of the caches made a 16-slot GRPO queue 1.13x
# (AR) and 1.21x (speculative) faster on the 2-core CPU (docs/BENCHMARKS.md, "Attention over
# the live part of the cache"); smaller chunks cost more loop steps, and for small buffers (one
# row of that target) the loop's fixed cost outweighs what it saves.
CACHE_CHUNK = 128
# a cached forward of more tokens than this (a prefill) attends this many queries at a time, so
# its scores take [B, H, QUERY_BLOCK, S] whatever the prompt's length (`layers.attend_cache`)
QUERY_BLOCK = 256
CACHE_CHUNK_MIN_BYTES = 256 * 1024
# A chunked read (above) of at most this many queries per kv head (a decode or verify step)
# whose furthest row is in the buffers' last chunk reads them whole in one pass, its products as
# multiply-and-sum (`layers._attend_cache_whole`): on the 2-core CPU the speculative arm of a
# GRPO queue ran 1.10-1.16x faster so, its AR arms within noise (docs/BENCHMARKS.md, "Attention
# over the live part of the cache"). 0: always the loop
SUMS_MAX_QUERIES = 16
# Backends whose cached attention reads in chunks; elsewhere it reads whole. The loop's trip
# count is dynamic, and on a GPU such a loop hands its condition back to the host at every
# iteration, while a whole read runs at the device's bandwidth: on an H100 the chunked paged
# path took 1.66x the time of the whole gather (docs/BENCHMARKS.md, "GPU").
CHUNKED_READ_BACKENDS = ("cpu",)


def chunk_min_bytes() -> int:
  """The smallest key buffer (bytes per layer) that attention reads in chunks on the default
  backend: `CACHE_CHUNK_MIN_BYTES` on the `CHUNKED_READ_BACKENDS`, else none (read at trace
  time)."""
  return CACHE_CHUNK_MIN_BYTES if jax.default_backend() in CHUNKED_READ_BACKENDS else sys.maxsize


@struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # per layer [B, Hkv, Dh, S]
  v: tuple[jax.Array, ...]  # per layer [B, Hkv, S, Dh]
  lengths: jax.Array  # int32[B]
  window: int = struct.field(pytree_node=False, default=0)  # positions attention reads; 0 = all

  @classmethod
  def create(cls, num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> "KVCache":
    k_shape = (batch, num_kv_heads, head_dim, size)
    v_shape = (batch, num_kv_heads, size, head_dim)
    return cls(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers)),
               v=tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers)),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def size(self) -> int:
    return self.v[0].shape[2]

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

  def keep_path(self, path: jax.Array, nodes: int) -> "KVCache":
    """After a forward over a draft tree of `nodes` nodes (node t written at lengths + t): the
    entries of the nodes on `path` int32[B, P] moved to lengths + 0 .. P - 1, where the next
    steps read them as a chain (`specjax.models.tree`)."""
    return self.replace(k=tuple(gather_path(b, self.lengths, path, nodes, axis=3) for b in self.k),
                        v=tuple(gather_path(b, self.lengths, path, nodes, axis=2) for b in self.v))


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array, axis: int) -> jax.Array:
  """buf[b, ..., start[b] : start[b] + T (on `axis`), ...] = new[b] for every row b (`new` laid
  out like `buf`, with T positions on `axis`)."""

  def one(row, upd, s):
    idx = tuple(s if d == axis - 1 else 0 for d in range(row.ndim))
    return jax.lax.dynamic_update_slice(row, upd.astype(row.dtype), idx)

  return jax.vmap(one)(buf, new, start)


def gather_path(buf: jax.Array, start: jax.Array, path: jax.Array, nodes: int,
                axis: int) -> jax.Array:
  """buf[b, .., start[b] + j (on `axis`), ..] = buf[b, .., start[b] + path[b, j], ..] for the
  P = path.shape[1] positions j (the `nodes` positions from start[b] must lie in the buffer)."""

  def one(row, s, p):
    block = jax.lax.dynamic_slice_in_dim(row, s, nodes, axis=axis - 1)
    moved = jnp.take(block, p, axis=axis - 1)
    return jax.lax.dynamic_update_slice_in_dim(row, moved, s, axis=axis - 1)

  return jax.vmap(one)(buf, start, path)


def write_keys(buf: jax.Array, k: jax.Array, start: jax.Array) -> jax.Array:
  """Keys k [B, T, Hkv, Dh] into a key buffer [B, Hkv, Dh, S] at each row's `start`."""
  return write_rows(buf, jnp.transpose(k, (0, 2, 3, 1)), start, axis=3)


def write_values(buf: jax.Array, v: jax.Array, start: jax.Array) -> jax.Array:
  """Values v [B, T, Hkv, Dh] into a value buffer [B, Hkv, S, Dh] at each row's `start`."""
  return write_rows(buf, jnp.transpose(v, (0, 2, 1, 3)), start, axis=2)
