"""The EAGLE-3 draft head (Flax NNX): fuse the target's auxiliary states, one 2d-wide decoder layer.

The token embedding is the policy's own table, passed into every call and wrapped in
`stop_gradient`: the head owns no embedding and the draft loss never trains the policy's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.layers import MLP, Attention, RMSNorm, param


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """Shape of the head; `target` is the policy's config (hidden size, heads, RoPE are shared)."""

  target: ModelConfig
  draft_vocab: int  # N; N == target.vocab_size means the full vocabulary

  def __post_init__(self):
    v = self.target.vocab_size
    if not 1 <= self.draft_vocab <= v:
      raise ValueError(f"HeadConfig.draft_vocab: must lie in [1, {v}], got {self.draft_vocab}")

  @property
  def hidden_size(self) -> int:
    return self.target.hidden_size

  @property
  def num_aux(self) -> int:
    return len(self.target.aux_layer_ids)


class Eagle3Head(nnx.Module):
  """fc(3d -> d) over the aux states; layer on concat(norm(embed(token)), norm(h)); own LM head.

  A step maps (h[B, T, d], token[B, T]) -> pre-norm output h'[B, T, d] (fed back as the next
  step's h) and draft logits over the N draft ids (`logits(h')`).
  """

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    t = cfg.target
    d, pd, std = t.hidden_size, t.params_dtype, t.init_std
    self.cfg = cfg
    self.fc = param(rngs, (cfg.num_aux * d, d), ("embed", "embed"), pd, std)
    self.embed_norm = RMSNorm(d, t.rms_eps, pd, rngs=rngs)
    self.hidden_norm = RMSNorm(d, t.rms_eps, pd, rngs=rngs)
    self.attn = Attention(t, rngs=rngs, in_dim=2 * d)
    self.post_attn_norm = RMSNorm(d, t.rms_eps, pd, rngs=rngs)
    self.mlp = MLP(t, rngs=rngs)
    self.final_norm = RMSNorm(d, t.rms_eps, pd, rngs=rngs)
    self.lm_head = param(rngs, (d, cfg.draft_vocab), ("embed", "vocab"), pd, std)
    self.dtype = t.compute_dtype

  def fuse(self, aux_hidden: jax.Array) -> jax.Array:
    """[B, T, n_aux * d] target features -> [B, T, d]."""
    dt = self.dtype
    return aux_hidden.astype(dt) @ self.fc[...].astype(dt)

  def __call__(self, embed_table: jax.Array, hidden: jax.Array, tokens: jax.Array,
               positions: jax.Array, mask: jax.Array, kv=None, write_at=None, visible=None):
    """One head step. `embed_table` [V, d] is the policy's; tokens[b, t] is the token that
    follows the state hidden[b, t]. Returns (h' [B, T, d], kv) as `Attention` does."""
    dt = self.dtype
    emb = jnp.take(jax.lax.stop_gradient(embed_table), tokens, axis=0).astype(dt)
    hidden = hidden.astype(dt)
    x = jnp.concatenate([self.embed_norm(emb), self.hidden_norm(hidden)], axis=-1)
    a, kv = self.attn(x, positions, mask, kv, write_at, visible)
    h = hidden + a.astype(dt)
    h = h + self.mlp(self.post_attn_norm(h)).astype(dt)
    return h, kv

  def logits(self, h: jax.Array) -> jax.Array:
    """float32 draft logits [..., N] from pre-norm outputs."""
    dt = self.dtype
    return jnp.einsum("...d,dn->...n", self.final_norm(h).astype(dt), self.lm_head[...].astype(dt),
                      preferred_element_type=jnp.float32)


def init_head(target_cfg: ModelConfig, draft_vocab: int | None = None, seed: int = 0,
              qk_norm: bool = False) -> Eagle3Head:
  """A fresh head for a target; `draft_vocab` None -> the full vocabulary. Its decoder layer is
  Llama's (`qk_norm` False) whatever the target's, as published EAGLE-3 heads are
  (LlamaForCausalLMEagle3), so that vLLM and SGLang load what `save_eagle3_hf` writes of it;
  True: q/k norm as in a Qwen3 layer (a format only specjax reads)."""
  n = target_cfg.vocab_size if draft_vocab is None else draft_vocab
  return Eagle3Head(HeadConfig(target_cfg.replace(qk_norm=qk_norm), n), rngs=nnx.Rngs(seed))
