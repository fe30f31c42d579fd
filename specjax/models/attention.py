"""Causal self-attention whose memory is linear in sequence length (training and logprob passes).

A fused kernel where the backend has one (cuDNN on GPU, half precision); elsewhere blockwise
attention with an online softmax and a recomputing backward, so no [T, T] score matrix is kept.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def has_fused_kernel(dtype) -> bool:
  """cuDNN's fused attention: GPU backend, float16 or bfloat16 inputs."""
  return jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.float16, jnp.bfloat16)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block: int,
                     fused: bool | None = None, segments: jax.Array | None = None) -> jax.Array:
  """Causal grouped-query attention over token index. q [B, T, H, Dh], k/v [B, T, Hkv, Dh]
  -> [B, T, H, Dh]. `block` (static) is the query/key block of the chunked path; `fused`
  None picks cuDNN where `has_fused_kernel` says it exists. `segments` int[B, T] (packed rows):
  a query sees only the keys of its own segment."""
  if fused is None:
    fused = has_fused_kernel(q.dtype) and segments is None
  if fused:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  if block <= 0:  # dense: one block holding the whole sequence
    return chunked_attention(q, k, v, block=q.shape[1], segments=segments)[0]
  return chunked_attention(q, k, v, block=block, segments=segments)[0]


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block: int,
                      segments: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(out [B, T, H, Dh], logsumexp of the scaled scores float32[B, T, H]) of causal GQA, computed
  block x block; both outputs are differentiable (the logsumexp lets callers merge more keys).
  `segments` int[B, T]: attention stays inside each segment (packed sequences)."""
  b, t, h, dh = q.shape
  hkv = k.shape[2]
  blk = max(1, min(int(block), t))
  pad = -t % blk
  if pad:
    widen = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q, k, v = widen(q), widen(k), widen(v)
    if segments is not None:  # padding: a segment of its own, after every real position
      segments = jnp.pad(segments, ((0, 0), (0, pad)), constant_values=-1)
  # [n, B, blk, Hkv, G, Dh]: blocks first, for lax.map / scan
  qb = q.reshape(b, -1, blk, hkv, h // hkv, dh).transpose(1, 0, 2, 3, 4, 5)
  kb = k.reshape(b, -1, blk, hkv, dh).transpose(1, 0, 2, 3, 4)
  vb = v.reshape(b, -1, blk, hkv, dh).transpose(1, 0, 2, 3, 4)
  sb = None if segments is None else segments.reshape(b, -1, blk).transpose(1, 0, 2)
  out, lse = _flash(qb, kb, vb, sb)
  out = out.transpose(1, 0, 2, 3, 4, 5).reshape(b, -1, h, dh)[:, :t]
  lse = lse.transpose(1, 0, 2, 3, 4).reshape(b, -1, h)[:, :t]
  return out, lse


def _block_scores(qi, kj, i, j, sb=None):
  """Scaled float32 scores [B, blk, Hkv, G, blk] of query block i against key block j, and the
  causal mask (padding sits at the end, after every real position, so it never leaks in); with
  segment blocks `sb` [n, B, blk], also the same-segment mask."""
  blk, dh = qi.shape[1], qi.shape[-1]
  s = jnp.einsum("bqkgd,bskd->bqkgs", qi, kj, preferred_element_type=jnp.float32)
  s = s / math.sqrt(dh)
  qpos = i * blk + jnp.arange(blk)
  kpos = j * blk + jnp.arange(blk)
  mask = (kpos[None, :] <= qpos[:, None])[None, :, None, None, :]
  if sb is not None:
    mask = mask & (sb[i][:, :, None] == sb[j][:, None, :])[:, :, None, None, :]
  return s, mask


@jax.custom_vjp
def _flash(qb, kb, vb, sb):
  return _flash_fwd(qb, kb, vb, sb)[0]


def _flash_forward(qb, kb, vb, sb):
  n = qb.shape[0]
  shape = qb.shape[1:-1]  # B, blk, Hkv, G

  def query_block(args):
    i, qi = args

    def key_block(carry, j):
      def visit(carry):
        m, l, acc = carry
        s, mask = _block_scores(qi, kb[j], i, j, sb)
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, NEG_INF), axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        pv = jnp.einsum("bqkgs,bskd->bqkgd", p.astype(vb.dtype), vb[j],
                        preferred_element_type=jnp.float32)
        return m_new, l * scale + p.sum(-1), acc * scale[..., None] + pv

      # blocks above the diagonal are fully masked: skip their work
      return jax.lax.cond(j <= i, visit, lambda c: c, carry), None

    init = (jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (qb.shape[-1],), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(key_block, init, jnp.arange(n))
    l = jnp.maximum(l, 1e-30)  # padded query rows see nothing
    return (acc / l[..., None]).astype(qb.dtype), m + jnp.log(l)

  return jax.lax.map(query_block, (jnp.arange(n), qb))


def _flash_fwd(qb, kb, vb, sb):
  out, lse = _flash_forward(qb, kb, vb, sb)
  return (out, lse), (qb, kb, vb, sb, out, lse)


def _flash_bwd(res, cts):
  qb, kb, vb, sb, out, lse = res
  dout, dlse = cts
  n, dh = qb.shape[0], qb.shape[-1]
  dout = dout.astype(jnp.float32)
  # d score = p * (dp - delta); a cotangent on lse adds p * dlse
  delta = jnp.sum(dout * out.astype(jnp.float32), axis=-1) - dlse.astype(jnp.float32)
  inv = 1.0 / math.sqrt(dh)

  def grads_of(i, j):
    s, mask = _block_scores(qb[i], kb[j], i, j, sb)
    p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
    dp = jnp.einsum("bqkgd,bskd->bqkgs", dout[i], vb[j].astype(jnp.float32))
    ds = p * (dp - delta[i][..., None])
    return p, ds

  def dq_block(i):
    def body(acc, j):
      def visit(acc):
        _, ds = grads_of(i, j)
        return acc + jnp.einsum("bqkgs,bskd->bqkgd", ds, kb[j].astype(jnp.float32)) * inv
      return jax.lax.cond(j <= i, visit, lambda a: a, acc), None

    acc, _ = jax.lax.scan(body, jnp.zeros(qb.shape[1:], jnp.float32), jnp.arange(n))
    return acc

  def dkv_block(j):
    def body(acc, i):
      def visit(acc):
        dk, dv = acc
        p, ds = grads_of(i, j)
        dv = dv + jnp.einsum("bqkgs,bqkgd->bskd", p, dout[i])
        dk = dk + jnp.einsum("bqkgs,bqkgd->bskd", ds, qb[i].astype(jnp.float32)) * inv
        return dk, dv
      return jax.lax.cond(j <= i, visit, lambda a: a, acc), None

    zeros = jnp.zeros(kb.shape[1:], jnp.float32)
    (dk, dv), _ = jax.lax.scan(body, (zeros, zeros), jnp.arange(n))
    return dk, dv

  dq = jax.lax.map(dq_block, jnp.arange(n))
  dk, dv = jax.lax.map(dkv_block, jnp.arange(n))
  return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def online_softmax_init(shape: tuple[int, ...], head_dim: int):
  """The running (max, denominator, numerator) of `online_softmax_step` for queries of `shape`."""
  return (jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape + (head_dim,), jnp.float32))


def online_softmax_step(carry, scores: jax.Array, mask: jax.Array, values: jax.Array,
                        spec: str):
  """Fold one chunk of keys into a running softmax: scaled float32 `scores` [..., c], `mask`
  (broadcast to them) of the keys each query sees, `values` contracted with the probabilities
  by the einsum `spec`. Masked keys weigh exactly 0, also while a query has seen none yet."""
  m, l, acc = carry
  scores = jnp.where(mask, scores, NEG_INF)
  m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
  p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
  corr = jnp.exp(m - m_new)
  pv = jnp.einsum(spec, p.astype(values.dtype), values, preferred_element_type=jnp.float32)
  return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv


def online_softmax_result(carry) -> jax.Array:
  """The attended values of a running softmax; 0 for a query that saw no key."""
  _, l, acc = carry
  return acc / jnp.where(l > 0, l, 1.0)[..., None]


def causal_attention_with_own_keys(q: jax.Array, k: jax.Array, v: jax.Array,
                                   own_k: list[jax.Array], own_v: list[jax.Array], *,
                                   block: int) -> jax.Array:
  """Causal GQA over (k, v) plus, for each query position t, the extra keys own_k[j][:, t] (values
  own_v[j][:, t]) seen by that position only: EAGLE-3's training-time-test attention, where the
  step-i query sees the target-feature keys causally and its own chain's keys at t. Shapes as in
  `causal_attention`; memory linear in T."""
  b, t, h, dh = q.shape
  hkv = k.shape[2]
  out, lse = chunked_attention(q, k, v, block=block if block > 0 else t)
  if not own_k:
    return out
  qg = q.reshape(b, t, hkv, h // hkv, dh).astype(jnp.float32)
  # scores of the own keys [n, B, T, Hkv, G] and the merged softmax over {causal block, own keys}
  s = jnp.stack([jnp.einsum("btkgd,btkd->btkg", qg, kj.astype(jnp.float32)) for kj in own_k])
  s = s / math.sqrt(dh)
  lse = lse.reshape(b, t, hkv, h // hkv)
  m = jnp.maximum(lse, jnp.max(s, axis=0))
  w_causal = jnp.exp(lse - m)
  w_own = jnp.exp(s - m)
  norm = w_causal + w_own.sum(0)
  vals = jnp.stack([vj.astype(jnp.float32) for vj in own_v])  # [n, B, T, Hkv, Dh]
  mixed = (w_causal[..., None] * out.reshape(b, t, hkv, h // hkv, dh).astype(jnp.float32)
           + jnp.einsum("nbtkg,nbtkd->btkgd", w_own, vals))
  return (mixed / norm[..., None]).reshape(b, t, h, dh).astype(q.dtype)
