"""Building blocks of the decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Every parameter carries its logical axes (`logical_axes` metadata) where it is defined; the
sharding rules in `specjax.sharding` map those names to mesh axes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.attention import (causal_attention, online_softmax_init,
                                      online_softmax_result, online_softmax_step)
from specjax.models import cache as cache_lib
from specjax.models.cache import write_keys, write_values
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.paged import PagedLayer

NEG_INF = -1e30


def param(rngs: nnx.Rngs, shape, axes: tuple[str, ...], dtype, std: float | None = 0.02) -> nnx.Param:
  """A parameter annotated with logical axes; std=None initialises to ones (norm scales)."""
  assert len(shape) == len(axes), (shape, axes)
  if std is None:
    value = jnp.ones(shape, dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, dtype, *, rngs: nnx.Rngs, axis_name: str = "norm"):
    self.scale = param(rngs, (dim,), (axis_name,), dtype, std=None)
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None:
    return inv_freq
  # Llama-3: keep high frequencies, divide low ones by `factor`, interpolate in between.
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  mid = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  return jnp.where(is_mid, mid, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """x [B, T, H, Dh], positions int[B, T]; rotate-half convention (as in HF Llama/Qwen)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _attention_probs(scores: jax.Array, mask: jax.Array, head_dim: int, dtype) -> jax.Array:
  """Softmax over the keys of scores [B, Hkv, G, T, S] / sqrt(head_dim), masked by bool[B, T, S]."""
  scores = scores / math.sqrt(head_dim)
  scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
  return jax.nn.softmax(scores, axis=-1).astype(dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention. q [B,T,H,Dh], k/v [B,S,Hkv,Dh], mask bool[B,T,S] -> [B,T,H,Dh]."""
  b, t, h, dh = q.shape
  hkv = k.shape[2]
  q = q.reshape(b, t, hkv, h // hkv, dh)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
  probs = _attention_probs(scores, mask, dh, v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, dh)


def attend_cache(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                 chunk: int | None = None, min_bytes: int | None = None,
                 query_block: int | None = None) -> jax.Array:
  """`attend` over KV-cache buffers (`KVCache` layout): q [B,T,H,Dh], k [B,Hkv,Dh,S],
  v [B,Hkv,S,Dh], mask bool[B,T,S] -> [B,T,H,Dh]. A query that sees no key returns 0.

  Reads only the cache's live extent (up to the last position any query sees), in about `chunk`
  positions at a time with an online softmax: the loop's trip count is dynamic, so one compiled
  program serves every length and a step over short rows does not read the rest of the buffers.
  Key buffers under `min_bytes`, or of one chunk, are read whole (defaults: `CACHE_CHUNK` and
  `chunk_min_bytes()` in `specjax.models.cache`, read at trace time: off the CPU, every buffer
  is read whole). A decode or verify step (at most `SUMS_MAX_QUERIES` queries per kv head) whose
  furthest row is in the last chunk reads them whole in one pass instead, its products as
  multiply-and-sum. Either way differentiable: a loop of dynamic length has no reverse mode, so
  the chunked read's gradient is the whole read's (EAGLE-3's training-time test attends over a
  cache).

  More than `query_block` queries (default `QUERY_BLOCK`: a prefill) attend that many at a time,
  so the scores held at once do not grow with the prompt."""
  block = cache_lib.QUERY_BLOCK if query_block is None else int(query_block)
  b, t, h, dh = q.shape
  if t > block:
    n = -(-t // block)
    pad = n * block - t  # padded queries see no key and return 0; dropped below
    qs = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, block, h, dh)
    ms = jnp.pad(mask, ((0, 0), (0, pad), (0, 0))).reshape(b, n, block, mask.shape[-1])
    out = jax.lax.map(lambda qm: attend_cache(qm[0], k, v, qm[1], chunk=chunk,
                                              min_bytes=min_bytes, query_block=block),
                      (qs.swapaxes(0, 1), ms.swapaxes(0, 1)))
    return out.swapaxes(0, 1).reshape(b, n * block, h, dh)[:, :t]
  chunk = cache_lib.CACHE_CHUNK if chunk is None else int(chunk)
  min_bytes = cache_lib.chunk_min_bytes() if min_bytes is None else int(min_bytes)
  s = k.shape[-1]
  n_max = -(-s // max(1, chunk))
  if n_max == 1 or k.size * k.dtype.itemsize < min_bytes:
    return _attend_cache_whole(q, k, v, mask)
  return _attend_cache_chunked(q, k, v, mask, -(-s // n_max))  # chunks of equal width


def _attend_cache_whole(q, k, v, mask, sums: bool = False):
  """One read of the whole buffers. `sums`: both products as multiply-and-sum in float32; on
  XLA's CPU backend a few queries per kv head read the buffers faster this way than through its
  batched matrix products (`cache.SUMS_MAX_QUERIES`)."""
  b, t, h, dh = q.shape
  hkv = k.shape[1]
  q = q.reshape(b, t, hkv, h // hkv, dh).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, Dh]
  f32 = jnp.float32
  if sums:
    scores = jnp.sum(q.astype(f32)[..., None] * k.astype(f32)[:, :, None, None], axis=-2)
  else:
    scores = jnp.einsum("bkgtd,bkds->bkgts", q, k, preferred_element_type=f32)
  probs = _attention_probs(scores, mask, dh, f32 if sums else v.dtype)
  probs = jnp.where(jnp.any(mask, axis=-1)[:, None, None, :, None], probs, 0)
  if sums:
    out = jnp.sum(probs[..., None] * v.astype(f32)[:, :, None, None], axis=-2).astype(v.dtype)
  else:
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend_cache_chunked(q, k, v, mask, c: int):
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[-1]
  n_max = -(-s // c)
  pos = jnp.arange(s, dtype=jnp.int32)
  extent = jnp.max(jnp.where(mask, pos + 1, 0))
  n = jnp.clip((extent + c - 1) // c, 1, n_max)
  if t * (h // hkv) <= cache_lib.SUMS_MAX_QUERIES:  # a decode or verify step
    # a step whose furthest row is in the last chunk reads the buffers whole, in one pass
    return jax.lax.cond(n == n_max, functools.partial(_attend_cache_whole, sums=True),
                        functools.partial(_chunk_loop, c=c, n=n), q, k, v, mask)
  return _chunk_loop(q, k, v, mask, c=c, n=n)


def _chunk_loop(q, k, v, mask, *, c: int, n: jax.Array):
  """Attention over the first `n` chunks of `c` positions, an online softmax over them."""
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[-1]
  q = q.reshape(b, t, hkv, h // hkv, dh).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, Dh]
  scale = 1.0 / math.sqrt(dh)

  def body(i, carry):
    # the last chunk may start early to stay inside the buffers: positions an earlier chunk
    # already counted are masked out
    start = jnp.minimum(i * c, s - c)
    kc = jax.lax.dynamic_slice_in_dim(k, start, c, axis=3)
    vc = jax.lax.dynamic_slice_in_dim(v, start, c, axis=2)
    mc = (jax.lax.dynamic_slice_in_dim(mask, start, c, axis=2)
          & (start + jnp.arange(c) >= i * c)[None, None, :])[:, None, None]  # [B, 1, 1, T, c]
    sc = jnp.einsum("bkgtd,bkds->bkgts", q, kc, preferred_element_type=jnp.float32) * scale
    return online_softmax_step(carry, sc, mc, vc, "bkgts,bksd->bkgtd")

  carry = online_softmax_init((b, hkv, h // hkv, t), dh)
  out = online_softmax_result(jax.lax.fori_loop(0, n, body, carry)).astype(v.dtype)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


def _attend_cache_chunked_fwd(q, k, v, mask, c):
  return _attend_cache_chunked(q, k, v, mask, c), (q, k, v, mask)


def _attend_cache_chunked_bwd(c, residuals, g):
  q, k, v, mask = residuals
  _, vjp = jax.vjp(lambda q, k, v: _attend_cache_whole(q, k, v, mask), q, k, v)
  return (*vjp(g), None)


_attend_cache_chunked.defvjp(_attend_cache_chunked_fwd, _attend_cache_chunked_bwd)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, in_dim: int | None = None,
               in_axis: str = "embed"):
    d = in_dim or cfg.hidden_size
    pd, std = cfg.params_dtype, cfg.init_std
    self.q_proj = param(rngs, (d, cfg.num_heads, cfg.head_dim), (in_axis, "heads", "head_dim"), pd, std)
    self.k_proj = param(rngs, (d, cfg.num_kv_heads, cfg.head_dim), (in_axis, "kv_heads", "head_dim"),
                        pd, std)
    self.v_proj = param(rngs, (d, cfg.num_kv_heads, cfg.head_dim), (in_axis, "kv_heads", "head_dim"),
                        pd, std)
    self.o_proj = param(rngs, (cfg.num_heads, cfg.head_dim, cfg.hidden_size),
                        ("heads", "head_dim", "embed"), pd, std)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, pd, rngs=rngs, axis_name="head_dim")
      self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, pd, rngs=rngs, axis_name="head_dim")
    else:
      self.q_norm = self.k_norm = None
    self.rope = (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # static; frequencies fold at trace
    self.dtype = cfg.compute_dtype
    self.attention_block = cfg.attention_block

  def __call__(self, x, positions, mask, kv: tuple[jax.Array, jax.Array] | None = None,
               write_at: jax.Array | None = None, visible: int | None = None,
               segments: jax.Array | None = None):
    """Returns (out [B,T,d], (k, v)): with `kv` (a layer's `KVCache` buffers) the buffers are
    returned with the new entries written at `write_at[b]`; without it, the fresh k/v of this
    call ([B,T,Hkv,Dh]). `visible` (static): attend over the first `visible` cache positions only
    (mask [B, T, visible]). `segments` int[B, T] (mask None, packed rows): causal by index within
    each segment."""
    dt = self.dtype
    q, k, v = self.project(x, positions)
    if isinstance(kv, PagedLayer):  # paged KV memory: the pool comes back in place of (k, v)
      out, pool = kv.write_and_attend(q.astype(dt), k, v, write_at)
      return self.output(out), pool
    if kv is not None:
      k, v = write_keys(kv[0], k, write_at), write_values(kv[1], v, write_at)
      ks, vs = (k, v) if visible is None else (k[..., :visible], v[:, :, :visible])
      out = attend_cache(q, ks.astype(dt), vs.astype(dt), mask)
    elif mask is None:  # full sequence, causal by index (no cache): memory linear in T
      out = causal_attention(q, k, v, block=self.attention_block, segments=segments)
    else:
      out = attend(q, k.astype(dt), v.astype(dt), mask)
    return self.output(out), (k, v)

  def project(self, x, positions):
    """q [B,T,H,Dh], k and v [B,T,Hkv,Dh] of inputs x [B,T,d] at `positions` (RoPE applied)."""
    dt = self.dtype
    x = x.astype(dt)
    q = jnp.einsum("btd,dhk->bthk", x, self.q_proj[...].astype(dt))
    k = jnp.einsum("btd,dhk->bthk", x, self.k_proj[...].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, self.v_proj[...].astype(dt))
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_frequencies(*self.rope)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

  def output(self, attended):
    """Output projection of attended values [B,T,H,Dh] -> [B,T,d]."""
    return jnp.einsum("bthk,hkd->btd", attended, self.o_proj[...].astype(self.dtype))


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, pd, std = cfg.hidden_size, cfg.mlp_hidden, cfg.params_dtype, cfg.init_std
    self.gate = param(rngs, (d, f), ("embed", "mlp"), pd, std)
    self.up = param(rngs, (d, f), ("embed", "mlp"), pd, std)
    self.down = param(rngs, (f, d), ("mlp", "embed"), pd, std)
    self.dtype = cfg.compute_dtype

  def __call__(self, x):
    dt = self.dtype
    x = x.astype(dt)
    g = x @ self.gate[...].astype(dt)
    u = x @ self.up[...].astype(dt)
    return (jax.nn.silu(g) * u) @ self.down[...].astype(dt)


class DecoderLayer(nnx.Module):
  """Pre-norm transformer block (attention + SwiGLU, both with residuals)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.params_dtype, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.params_dtype, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, mask, kv=None, write_at=None, visible=None, segments=None):
    a, kv = self.attn(self.input_norm(x), positions, mask, kv, write_at, visible, segments)
    x = x + a.astype(x.dtype)
    x = x + self.mlp(self.post_attn_norm(x)).astype(x.dtype)
    return x, kv


def causal_mask(positions: jax.Array, key_positions: jax.Array) -> jax.Array:
  """bool[B, T, S]: query at position p sees keys at positions <= p."""
  return key_positions[:, None, :] <= positions[:, :, None]


def segment_mask(segments: jax.Array) -> jax.Array:
  """bool[B, T, T] of packed rows (segments int[B, T]): token t sees the tokens s <= t of its own
  segment."""
  t = segments.shape[1]
  idx = jnp.arange(t)
  return (idx[None, :] <= idx[:, None])[None] & (segments[:, None, :] == segments[:, :, None])
