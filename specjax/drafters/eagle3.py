"""Feature-chained drafters (EAGLE-3 head, native MTP module) behind the `Drafter` protocol, and
the `eagle3` draft method.

After each target forward the drafter runs its one-layer module on (target state at t, committed
token t + 1) pairs into its own KV cache; it then drafts K tokens by feeding back its own states.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.drafters.checkpoint import (eagle3_aux_layers, is_eagle3_hf_dir, load_draft_head,
                                     save_eagle3_hf)
from specjax.drafters.head import Eagle3Head, HeadConfig, init_head
from specjax.drafters.ttt import ttt_loss, ttt_loss_chunked
from specjax.drafters.vocab import VocabMaps, draft_to_target_probs, identity_maps
from specjax.errors import UserError
from specjax.models.cache import KVCache
from specjax.models.paged import PagedKV
from specjax.models.hf import config_from_hf
from specjax.models.layers import causal_mask
from specjax.sampling.drafter import Drafter, Sequences, TargetStep, top_alternatives
from specjax.drafters.methods import (DraftInit, DraftLossInputs, DraftMethodBase, OfflineDraft,
                                      register_method)


@struct.dataclass
class ChainState:
  cache: KVCache  # the drafter's own one-layer cache; lengths == the target's committed length
  hidden: jax.Array  # [B, d] drafter state at the last committed pair (its logits give draft 1)


@dataclasses.dataclass(frozen=True)
class ChainDrafter(Drafter):
  """Chain drafting with static K on a one-layer module; subclasses say what the module is.

  observe: pairs (feature[b, t], next_tokens[b, t]) are written at positions start[b] + t; the
  first num_new[b] become committed and the last of them gives the first draft. propose: draft 1
  from that pair; draft k + 1 from (the module's own output state, draft k) at position
  lengths[b] + k - 1, written beyond the committed length (invisible later, then overwritten).
  Proposals: sampled from softmax(logits / temperature) with those probabilities returned over the
  full vocabulary (0 outside a reduced draft vocabulary); temperature 0: argmax, probs None.
  """

  graphdef: Any = None  # nnx.GraphDef of the module the params merge into

  def __post_init__(self):
    if self.draft_len < 1:
      raise ValueError(f"{type(self).__name__}.draft_len: must be >= 1, got {self.draft_len}")
    if self.temperature < 0:
      raise ValueError(f"{type(self).__name__}.temperature: must be >= 0, got {self.temperature}")
    if self.tree_width < 1:
      raise ValueError(f"{type(self).__name__}.tree_width: must be >= 1, got {self.tree_width}")
    if self.graphdef is None:
      raise ValueError(f"{type(self).__name__}.graphdef: required (nnx.split of the module)")

  # -- what a subclass provides --------------------------------------------------------------
  def features(self, params, step: TargetStep) -> jax.Array:
    """[B, T, d] states paired with step.next_tokens."""
    raise NotImplementedError

  def run(self, params, hidden, tokens, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Module on [B, T] pairs written at cache.lengths[b] ..; -> (states [B, T, d], cache)."""
    raise NotImplementedError

  def draft_logits(self, params, hidden: jax.Array) -> jax.Array:
    """float32 [B, N] logits from states [B, d]."""
    raise NotImplementedError

  def vocab_maps(self, params) -> VocabMaps | None:
    """Draft -> target ids; None when the draft vocabulary is the target's."""
    return None

  def cache_spec(self) -> tuple[int, int, Any]:
    """(num_kv_heads, head_dim, dtype) of the one-layer cache."""
    raise NotImplementedError

  def hidden_size(self) -> int:
    raise NotImplementedError

  # -- the protocol ----------------------------------------------------------------------------
  def init(self, params, batch: int, cache_size: int) -> ChainState:
    hkv, dh, dtype = self.cache_spec()
    # room for K - 1 chained entries beyond a full target cache
    cache = KVCache.create(1, batch, cache_size + self.draft_len, hkv, dh, dtype)
    return ChainState(cache=cache, hidden=jnp.zeros((batch, self.hidden_size()), dtype))

  def observe(self, params, state: ChainState, step: TargetStep) -> ChainState:
    feats = self.features(params, step)
    out, cache = self.run(params, feats, step.next_tokens, state.cache.with_lengths(step.start))
    last = jnp.maximum(step.num_new - 1, 0)
    hidden = jnp.take_along_axis(out, last[:, None, None], axis=1)[:, 0]
    # the first draft's logits are left to `propose`: a plain AR step observes without drafting
    return ChainState(cache=cache.with_lengths(step.start + step.num_new), hidden=hidden)

  def _pick(self, params, logits: jax.Array, key: jax.Array, argmax: bool = False):
    maps = self.vocab_maps(params)
    if self.temperature == 0 or argmax:
      ids, probs = jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    else:
      logp = jax.nn.log_softmax(logits / self.temperature, axis=-1)
      ids = jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
      probs = jnp.exp(logp)
      if maps is not None:
        probs = draft_to_target_probs(probs, maps)
    tokens = ids if maps is None else jnp.take(maps.d2t, ids)
    return tokens, probs

  def _alternatives(self, params, logits: jax.Array, tokens: jax.Array) -> jax.Array:
    maps = self.vocab_maps(params)
    return top_alternatives(logits, tokens, self.tree_width, None if maps is None else maps.d2t)

  def propose(self, params, state: ChainState, seq: Sequences, key: jax.Array):
    tokens, probs, _, state = self._draft(params, state, key, alternatives=False)
    return tokens, probs, state

  def propose_tree(self, params, state: ChainState, seq: Sequences, key: jax.Array):
    return self._draft(params, state, key, alternatives=True)

  @property
  def drafts_trees(self) -> bool:
    return True

  def _draft(self, params, state: ChainState, key: jax.Array, alternatives: bool):
    keys = jax.random.split(key, self.draft_len)
    alts = (lambda logits, tok: self._alternatives(params, logits, tok)) if alternatives else \
        (lambda logits, tok: jnp.zeros((tok.shape[0], 0), jnp.int32))
    argmax = alternatives and self.tree_argmax
    first_logits = self.draft_logits(params, state.hidden)
    first_tok, first_probs = self._pick(params, first_logits, keys[0], argmax)
    first_alts = alts(first_logits, first_tok)
    committed = state.cache.lengths

    def chain(carry, xs):
      hidden, tok, cache = carry
      k, step_key = xs
      out, cache = self.run(params, hidden[:, None], tok[:, None],
                            cache.with_lengths(committed + k - 1))
      hidden = out[:, 0]
      logits = self.draft_logits(params, hidden)
      nxt, probs = self._pick(params, logits, step_key, argmax)
      return (hidden, nxt, cache), (nxt, probs, alts(logits, nxt))

    steps = (jnp.arange(1, self.draft_len, dtype=jnp.int32), keys[1:])
    (_, _, cache), (toks, probs, more) = jax.lax.scan(
        chain, (state.hidden, first_tok, state.cache), steps)
    tokens = jnp.concatenate([first_tok[:, None], jnp.swapaxes(toks, 0, 1)], axis=1)
    if first_probs is not None:
      probs = jnp.concatenate([first_probs[:, None], jnp.swapaxes(probs, 0, 1)], axis=1)
    alternatives = jnp.concatenate([first_alts[:, None], jnp.swapaxes(more, 0, 1)], axis=1)
    return tokens, probs, alternatives, state.replace(cache=cache.with_lengths(committed))


@struct.dataclass
class Eagle3Params:
  """The drafter's params: `embed` IS the policy's embedding array (shared, never trained here)."""

  head: nnx.State
  embed: jax.Array  # [V, d]
  maps: VocabMaps


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(ChainDrafter):
  """EAGLE-3 head as a drafter; params are `Eagle3Params`."""

  head_cfg: HeadConfig | None = None

  def __post_init__(self):
    super().__post_init__()
    if self.head_cfg is None:
      raise ValueError("Eagle3Drafter.head_cfg: required (the head's HeadConfig)")

  def _head(self, params: Eagle3Params) -> Eagle3Head:
    return nnx.merge(self.graphdef, params.head)

  def features(self, params, step):
    return self._head(params).fuse(step.out.aux_hidden)

  def run(self, params, hidden, tokens, cache):
    head = self._head(params)
    b, t = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    if isinstance(cache, PagedKV):  # on the target's pages: attention masks by position itself
      out, pool = head(params.embed, hidden, tokens, positions, None, cache.layer_view(0),
                       cache.lengths)
      return out, pool
    keys = jnp.broadcast_to(jnp.arange(cache.visible, dtype=jnp.int32), (b, cache.visible))
    mask = causal_mask(positions, keys)
    out, (k, v) = head(params.embed, hidden, tokens, positions, mask, (cache.k[0], cache.v[0]),
                       cache.lengths, cache.visible)
    return out, cache.replace(k=(k,), v=(v,))

  def draft_logits(self, params, hidden):
    return self._head(params).logits(hidden)

  def vocab_maps(self, params):
    return params.maps

  def cache_spec(self):
    t = self.head_cfg.target
    return t.num_kv_heads, t.head_dim, t.compute_dtype

  def page_layout(self, params):
    return (1,) + self.cache_spec()

  def hidden_size(self):
    return self.head_cfg.hidden_size


def eagle3_drafter(head: Eagle3Head, embed_table: jax.Array, maps: VocabMaps, *, draft_len: int,
                   temperature: float = 1.0) -> tuple[Eagle3Drafter, Eagle3Params]:
  """(drafter, params) for a head; `embed_table` must be the policy's own array."""
  if maps.draft_vocab != head.cfg.draft_vocab:
    raise ValueError(f"eagle3_drafter: maps have {maps.draft_vocab} draft ids, the head "
                     f"{head.cfg.draft_vocab}")
  graphdef, state = nnx.split(head)
  drafter = Eagle3Drafter(draft_len=draft_len, vocab_size=maps.vocab_size,
                          temperature=temperature, graphdef=graphdef,
                          head_cfg=head.cfg)
  return drafter, Eagle3Params(head=state, embed=embed_table, maps=maps)


@dataclasses.dataclass(frozen=True)
class Eagle3Method(DraftMethodBase):
  """`eagle3`: an EAGLE-3 head (the `draft` object; a fresh one when None) in the "draft" group,
  trained online by the TTT loss on the policy's own features; it drafts with the policy's
  embedding and the vocabulary maps in `draft_aux`."""

  name: ClassVar[str] = "eagle3"

  def init(self, draft_cfg, *, policy_cfg, policy_params, draft, draft_maps, seed):
    head = draft if draft is not None else init_head(policy_cfg, seed=seed)
    head_params = nnx.split(head)[1] if isinstance(head, nnx.Module) else head[1]
    maps = draft_maps if draft_maps is not None else identity_maps(policy_cfg.vocab_size)
    return DraftInit(policy=policy_params, draft=head_params, draft_aux=maps, draft_obj=head)

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft, group_size):
    if draft is None:
      raise ValueError("DraftConfig.kind='eagle3' needs the EAGLE-3 head (module or split)")
    head = draft if isinstance(draft, nnx.Module) else nnx.merge(*draft)
    return Eagle3Drafter(draft_len=draft_cfg.draft_len, vocab_size=policy_cfg.vocab_size,
                         graphdef=nnx.graphdef(head), head_cfg=head.cfg), None

  def train_graphdef(self, drafter):
    return drafter.graphdef

  def sampler_params(self, params, policy, draft_aux, fixed):
    return Eagle3Params(head=params["draft"], embed=policy["embed"][...], maps=draft_aux)

  @property
  def online_loss(self):
    return _eagle3_online_loss

  def policy_overrides(self, draft_cfg, policy_dir):
    if not draft_cfg.path:
      return {}
    if not os.path.isdir(draft_cfg.path):
      raise UserError(f"DraftConfig.path: {draft_cfg.path} is not a directory (an EAGLE-3 "
                      "head: community format or specjax's orbax save_head)")
    if not is_eagle3_hf_dir(draft_cfg.path):
      return {}
    # a community head names the policy layers it was trained on; the policy must expose those
    aux = eagle3_aux_layers(draft_cfg.path, config_from_hf(policy_dir).num_layers)
    return {} if aux is None else {"aux_layers": aux}

  def offline_draft(self, draft_cfg, policy, env):
    if not draft_cfg.path:
      head, maps = env.train_eagle3(policy)
      return OfflineDraft(policy=policy, draft=head, draft_maps=maps)
    head, maps = load_draft_head(draft_cfg.path, policy.cfg, policy_embed=policy.embed[...])
    env.log(f"[draft] EAGLE-3 head {draft_cfg.path} (draft vocabulary {maps.draft_vocab} of "
            f"{maps.vocab_size})")
    return OfflineDraft(policy=policy, draft=head, draft_maps=maps)

  def save_draft(self, path, *, params, draft_aux, draft):
    graphdef = nnx.graphdef(draft) if isinstance(draft, nnx.Module) else draft[0]
    return save_eagle3_hf(path, nnx.merge(graphdef, params["draft"]), draft_aux)


def _eagle3_online_loss(x: DraftLossInputs):
  sg = jax.lax.stop_gradient
  if x.out.logits is not None:
    return ttt_loss(x.draft_graphdef, x.params["draft"], sg(x.embed), sg(x.out.aux_hidden),
                    sg(x.out.logits), x.tokens, x.mask, x.draft_aux, num_steps=x.ttt_steps)
  # the policy ran without logits (ModelConfig.logits_chunk): the target distribution comes
  # from its final hidden states and LM head, chunk by chunk
  policy = nnx.merge(x.policy_graphdef, sg(x.params["policy"]))
  cfg = policy.cfg
  return ttt_loss_chunked(x.draft_graphdef, x.params["draft"], sg(x.embed), sg(x.out.aux_hidden),
                          policy.final_norm(sg(x.out.hidden)), policy.head_weight(), x.tokens,
                          x.mask, x.draft_aux, num_steps=x.ttt_steps,
                          block=cfg.attention_block or cfg.logits_chunk,
                          chunk=cfg.logits_chunk)


register_method(Eagle3Method())
