"""The Qwen3/Llama-style decoder (Flax NNX), its output, and the optional native MTP module.

`Decoder(tokens[B, T])` returns logits, the last residual stream and the EAGLE-3 auxiliary hidden
states; with a `KVCache` it appends the T tokens at each row's own offset (see `cache.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.layers import DecoderLayer, RMSNorm, causal_mask, param, segment_mask
from specjax.models.paged import PagedKV
from specjax.models.tree import DraftTree


@struct.dataclass
class DecoderOutput:
  logits: jax.Array | None  # float32[B, T, V], None when compute_logits=False
  hidden: jax.Array  # [B, T, d] residual stream after the last layer, before the final norm
  aux_hidden: jax.Array  # [B, T, n_aux * d] inputs of cfg.aux_layer_ids, concatenated
  cache: KVCache | None = None


def positions_and_mask(batch: int, seq: int, cache: KVCache | None, positions=None,
                       tree: DraftTree | None = None):
  """Absolute positions [B, T] of the new tokens and the attention mask [B, T, S]. With a
  `tree` (a cache; T = tree.nodes), token t sits at position lengths + depth(t) and sees the
  committed cache and its ancestors in the tree, whose entries it writes at lengths + t. A paged
  cache masks by position itself: its mask is None, or with a tree the tree's own [B, T, T]
  (`PagedKV.layer_view`)."""
  if tree is not None:
    if not isinstance(cache, (KVCache, PagedKV)):
      raise ValueError("a draft tree is verified over a KV cache (cacheless forwards take "
                       "chains only)")
    if seq != tree.nodes:
      raise ValueError(f"a forward over {tree} takes "
                       f"{tree.nodes} tokens, got {seq}")
    positions = cache.lengths[:, None] + jnp.asarray(tree.depths)[None]
    if isinstance(cache, PagedKV):
      return positions, jnp.broadcast_to(jnp.asarray(tree.ancestors), (batch, seq, seq))
    rel = jnp.arange(cache.visible, dtype=jnp.int32)[None, :] - cache.lengths[:, None]  # [B, S]
    inside = (rel >= 0) & (rel < seq)
    anc = jnp.asarray(tree.ancestors)[:, jnp.clip(rel, 0, seq - 1)]  # [T, B, S]
    return positions, (rel < 0)[:, None, :] | (inside[:, None, :] & anc.transpose(1, 0, 2))
  if cache is not None:
    positions = cache.lengths[:, None] + jnp.arange(seq, dtype=jnp.int32)[None]
    if isinstance(cache, PagedKV):  # paged attention masks by position itself
      return positions, None
    keys = jnp.broadcast_to(jnp.arange(cache.visible, dtype=jnp.int32), (batch, cache.visible))
    return positions, causal_mask(positions, keys)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  return positions, causal_mask(positions, positions)


_REMAT = {"full": jax.checkpoint_policies.nothing_saveable,
          "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def remat_layer(layer: nnx.Module, policy: str):
  """`layer`'s call under a rematerialisation policy (ModelConfig.remat) for the backward pass."""
  if policy == "none":
    return layer
  return functools.partial(nnx.remat(lambda m, *args: m(*args), policy=_REMAT[policy]), layer)


class MTPModule(nnx.Module):
  """DeepSeek-V3 style MTP: from hidden state t and token t+1, predict token t+2."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = cfg.params_dtype
    self.embed_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, pd, rngs=rngs)
    self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, pd, rngs=rngs)
    self.proj = param(rngs, (2 * cfg.hidden_size, cfg.hidden_size), ("embed", "embed"), pd,
                      cfg.init_std)
    self.layer = DecoderLayer(cfg, rngs=rngs)
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, pd, rngs=rngs)
    self.dtype = cfg.compute_dtype

  def __call__(self, emb, hidden, positions, mask, kv=None, write_at=None, visible=None):
    x = jnp.concatenate([self.embed_norm(emb), self.hidden_norm(hidden.astype(emb.dtype))], -1)
    x = x.astype(self.dtype) @ self.proj[...].astype(self.dtype)
    return self.layer(x, positions, mask, kv, write_at, visible)


class Decoder(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd, std = cfg.params_dtype, cfg.init_std
    self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd, std)
    self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)]) \
        if hasattr(nnx, "List") else [DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)]
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, pd, rngs=rngs)
    self.lm_head = None if cfg.tie_embeddings else param(
        rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd, std)
    self.mtp = MTPModule(cfg, rngs=rngs) if cfg.mtp else None

  # -- pieces other modules reuse ------------------------------------------------------------
  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.compute_dtype)

  def head_weight(self) -> jax.Array:
    """The LM head [d, V] (the embedding's transpose when tied)."""
    return self.embed[...].T if self.lm_head is None else self.lm_head[...]

  def head(self, hidden: jax.Array, norm: RMSNorm | None = None) -> jax.Array:
    """Final norm (the decoder's, or `norm`) + LM head, float32 logits."""
    h = (norm or self.final_norm)(hidden)
    dt = self.cfg.compute_dtype
    w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    return jnp.einsum("btd,dv->btv", h.astype(dt), w.astype(dt),
                      preferred_element_type=jnp.float32)

  def init_cache(self, batch: int, size: int, dtype=None) -> KVCache:
    cfg = self.cfg
    return KVCache.create(cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim,
                          dtype or cfg.compute_dtype)

  def _linear_attention(self, cache, positions) -> bool:
    """Full-sequence forward with default positions and a block size: memory-linear attention."""
    return cache is None and positions is None and self.cfg.attention_block > 0

  # -- forward ---------------------------------------------------------------------------------
  def __call__(self, tokens: jax.Array, *, cache: KVCache | None = None,
               positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
               compute_logits: bool = True, tree: DraftTree | None = None) -> DecoderOutput:
    """`segment_ids` int[B, T] (no cache): packed rows, several sequences in a row; a token
    attends only to the earlier tokens of its own segment, at the `positions` given (each
    sequence's own, from 0). `tree` (static, with a cache, dense or paged): the T tokens are
    the nodes of a draft tree (`positions_and_mask`)."""
    b, t = tokens.shape
    if segment_ids is not None:
      if cache is not None or positions is None:
        raise ValueError("Decoder: segment_ids (packed rows) need positions and no cache")
      blocked = self.cfg.attention_block > 0
      mask = None if blocked else segment_mask(segment_ids)
      segments = segment_ids if blocked else None
    else:
      causal_by_index = self._linear_attention(cache, positions)
      positions, mask = positions_and_mask(b, t, cache, positions, tree)
      mask = None if causal_by_index else mask  # the layers then attend in blocks (attention.py)
      segments = None
    x = self.embed_tokens(tokens)
    aux_ids = self.cfg.aux_layer_ids
    aux = {}
    new_k, new_v = [], []
    paged = isinstance(cache, PagedKV)
    for i, layer in enumerate(self.layers):
      if i in aux_ids:
        aux[i] = x
      if paged:  # each layer writes into and reads from the shared pool (mask: a tree's)
        x, pool = layer(x, positions, None, cache.layer_view(i, mask), cache.lengths)
        cache = cache.replace(k=pool.k, v=pool.v)
      elif cache is None:
        x, _ = remat_layer(layer, self.cfg.remat)(x, positions, mask, None, None, None, segments)
      else:
        x, (k, v) = layer(x, positions, mask, (cache.k[i], cache.v[i]), cache.lengths,
                          cache.visible)
        new_k.append(k)
        new_v.append(v)
    new_cache = cache if cache is None or paged else cache.replace(k=tuple(new_k),
                                                                    v=tuple(new_v))
    return DecoderOutput(
        logits=self.head(x) if compute_logits else None,
        hidden=x,
        aux_hidden=jnp.concatenate([aux[i] for i in aux_ids], axis=-1),
        cache=new_cache)

  def mtp_forward(self, hidden: jax.Array, next_tokens: jax.Array, *,
                  cache: KVCache | None = None, positions: jax.Array | None = None,
                  compute_logits: bool = True) -> DecoderOutput:
    """MTP step: hidden[b, t] (decoder output at position t) and next_tokens[b, t] (token t+1)
    -> logits for token t+2. `cache` is a one-layer KVCache of the MTP module, or a one-layer
    PagedKV pool read through a page table."""
    if self.mtp is None:
      raise ValueError("mtp_forward: this decoder has no MTP module (ModelConfig.mtp=False)")
    b, t = next_tokens.shape
    causal_by_index = self._linear_attention(cache, positions)
    positions, mask = positions_and_mask(b, t, cache, positions)
    mask = None if causal_by_index else mask
    emb = self.embed_tokens(next_tokens)
    if cache is None:
      x, _ = self.mtp(emb, hidden, positions, mask)
      new_cache = None
    elif isinstance(cache, PagedKV):  # (paged attention masks by position itself)
      x, pool = self.mtp(emb, hidden, positions, None, cache.layer_view(0), cache.lengths)
      new_cache = cache.replace(k=pool.k, v=pool.v)
    else:
      x, (k, v) = self.mtp(emb, hidden, positions, mask, (cache.k[0], cache.v[0]), cache.lengths,
                           cache.visible)
      new_cache = cache.replace(k=(k,), v=(v,))
    logits = self.head(x, self.mtp.final_norm) if compute_logits else None
    return DecoderOutput(logits=logits, hidden=x, aux_hidden=x, cache=new_cache)

  def init_mtp_cache(self, batch: int, size: int, dtype=None) -> KVCache:
    cfg = self.cfg
    return KVCache.create(1, batch, size, cfg.num_kv_heads, cfg.head_dim, dtype or cfg.compute_dtype)
