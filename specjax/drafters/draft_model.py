"""The draft-model drafter: a smaller decoder with the target's vocabulary and its own KV cache,
proposing K tokens by sampling its processed distribution (and returning those probabilities).

`truncated_copy` builds a draft from the target itself (first layers + shared embedding and head),
the cheapest draft that agrees with a random-weight target often enough to benchmark with.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.errors import UserError
from specjax.models.cache import KVCache
from specjax.models.decoder import Decoder
from specjax.sampling.drafter import Drafter, Sequences, TargetStep, top_alternatives
from specjax.drafters.methods import DraftMethodBase, OfflineDraft, register_method
from specjax.sampling.processing import process_logits


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModelDrafter(Drafter):
  """Drafts with a `Decoder` given as its `graphdef` (static); its params are the loop's
  `drafter_params`. Proposals sample at `temperature` after the draft's own `top_k` / `top_p`
  (None: the whole tempered distribution); temperature 0 drafts greedily (probs None).

  The draft cache holds the committed tokens except the last two; `propose` feeds those two
  first, which also fills the entry of the K-th draft when every draft was accepted, so
  `observe` only has to encode the prompt.
  """

  graphdef: nnx.GraphDef
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if self.draft_len < 1:
      raise ValueError(f"DraftModelDrafter.draft_len: must be >= 1, got {self.draft_len}")
    if self.vocab_size is None:
      raise ValueError("DraftModelDrafter.vocab_size: required (the draft model's vocabulary); "
                       "build with DraftModelDrafter.from_model")

  @classmethod
  def from_model(cls, model: Decoder, draft_len: int, **kw) -> tuple["DraftModelDrafter", Any]:
    """(drafter, drafter_params) for a draft `Decoder`."""
    graphdef, params = nnx.split(model)
    return cls(draft_len=draft_len, vocab_size=model.cfg.vocab_size, graphdef=graphdef,
               **kw), params

  def page_layout(self, params):
    cfg = nnx.merge(self.graphdef, params).cfg
    return cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype

  def init(self, params, batch: int, cache_size: int) -> KVCache:
    return nnx.merge(self.graphdef, params).init_cache(batch, cache_size)

  def observe(self, params, state: KVCache, step: TargetStep) -> KVCache:
    def encode_prompt(cache):
      model = nnx.merge(self.graphdef, params)
      out = model(step.input_tokens, cache=cache.with_lengths(step.start), compute_logits=False)
      return out.cache.with_lengths(step.start + step.num_new)

    # only the prefill starts every row at position 0; a verify step leaves nothing to do
    return jax.lax.cond(jnp.all(step.start == 0), encode_prompt, lambda cache: cache, state)

  def _sample(self, key, logits, argmax: bool = False):
    if self.temperature == 0 or argmax:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    logq = process_logits(logits, temperature=self.temperature, top_k=self.top_k,
                          top_p=self.top_p)
    return jax.random.categorical(key, logq, axis=-1).astype(jnp.int32), jnp.exp(logq)

  @property
  def drafts_trees(self) -> bool:
    return True

  def propose(self, params, state: KVCache, seq: Sequences, key: jax.Array):
    drafts, probs, _, cache = self._draft(params, state, seq, key, alternatives=False)
    return drafts, probs, cache

  def propose_tree(self, params, state: KVCache, seq: Sequences, key: jax.Array):
    return self._draft(params, state, seq, key, alternatives=True)

  def _draft(self, params, state: KVCache, seq: Sequences, key: jax.Array, alternatives: bool):
    alts = (lambda logits, tok: top_alternatives(logits, tok, self.tree_width)) \
        if alternatives else (lambda logits, tok: jnp.zeros((tok.shape[0], 0), jnp.int32))
    model = nnx.merge(self.graphdef, params)
    lengths = seq.lengths
    idx = jnp.maximum(lengths[:, None] - 2 + jnp.arange(2)[None, :], 0)
    inputs = jnp.take_along_axis(seq.tokens, idx, axis=1)
    out = model(inputs, cache=state.with_lengths(lengths - 2), compute_logits=False)
    keys = jax.random.split(key, self.draft_len)
    argmax = alternatives and self.tree_argmax
    first_logits = model.head(out.hidden[:, -1:])[:, 0]
    first, q_first = self._sample(keys[0], first_logits, argmax)

    def step(carry, k):
      cache, tok = carry
      o = model(tok[:, None], cache=cache)
      nxt, q = self._sample(k, o.logits[:, 0], argmax)
      return (o.cache.advance(1), nxt), (nxt, q, alts(o.logits[:, 0], nxt))

    (cache, _), (rest, q_rest, alts_rest) = jax.lax.scan(
        step, (out.cache.with_lengths(lengths), first), keys[1:])
    drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
    others = jnp.concatenate([alts(first_logits, first)[:, None],
                              jnp.swapaxes(alts_rest, 0, 1)], axis=1)
    if q_first is None:
      return drafts, None, others, cache
    probs = jnp.concatenate([q_first[:, None], jnp.swapaxes(q_rest, 0, 1)], axis=1)
    return drafts, probs, others, cache


def truncated_copy(model: Decoder, num_layers: int) -> Decoder:
  """A draft `Decoder` made of the target's first `num_layers` layers, embedding, final norm and
  LM head (copied references: no new memory for the arrays)."""
  if not 1 <= num_layers <= model.cfg.num_layers:
    raise ValueError(f"truncated_copy: num_layers must be in [1, {model.cfg.num_layers}], "
                     f"got {num_layers}")
  cfg = model.cfg.replace(num_layers=num_layers, aux_layers=None, mtp=False)
  draft = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  pure = nnx.to_pure_dict(nnx.state(model))
  pure.pop("mtp", None)
  pure["layers"] = {i: v for i, v in pure["layers"].items() if int(i) < num_layers}
  state = nnx.state(draft)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(draft, state)
  return draft


@dataclasses.dataclass(frozen=True)
class DraftModelMethod(DraftMethodBase):
  """`draft-model`: a smaller `Decoder` (the `draft` object, module or split) with fixed params."""

  name: ClassVar[str] = "draft-model"

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft, group_size):
    if draft is None:
      raise ValueError("DraftConfig.kind='draft-model' needs a draft Decoder (run_rl(draft=...))")
    graphdef, params = nnx.split(draft) if isinstance(draft, nnx.Module) else draft
    vocab = nnx.merge(graphdef, params).cfg.vocab_size
    return DraftModelDrafter(draft_len=draft_cfg.draft_len, vocab_size=vocab,
                             graphdef=graphdef), params

  def offline_draft(self, draft_cfg, policy, env):
    if not draft_cfg.path:
      env.log(f"[draft] draft model: the policy's first {env.draft_model_layers} of "
              f"{policy.cfg.num_layers} layers (shared embedding and LM head)")
      draft = truncated_copy(policy, env.draft_model_layers)
      # its own arrays: the RL train step donates (reuses) the policy's buffers
      nnx.update(draft, jax.tree.map(jnp.copy, nnx.state(draft)))
      return OfflineDraft(policy=policy, draft=draft)
    from specjax.models.hf import load_pretrained

    if not os.path.isfile(os.path.join(draft_cfg.path, "config.json")):
      raise UserError(f"DraftConfig.path: {draft_cfg.path} is not a Hugging Face "
                      "directory (no config.json)")
    draft = load_pretrained(draft_cfg.path, dtype=policy.cfg.dtype)
    if draft.cfg.vocab_size != policy.cfg.vocab_size:
      raise UserError(f"DraftConfig.path: {draft_cfg.path} has vocab_size "
                      f"{draft.cfg.vocab_size}, the policy {policy.cfg.vocab_size}; a draft model "
                      "must share the policy's vocabulary")
    env.log(f"[draft] draft model {draft_cfg.path} ({draft.cfg.num_params() / 1e6:.2f}M params)")
    return OfflineDraft(policy=policy, draft=draft)


register_method(DraftModelMethod())
