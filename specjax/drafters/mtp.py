"""The decoder's native MTP module as a drafter, its loss (token t + 2), and the `mtp` draft method.

K = 1 per module; K > 1 feeds the module its own output state, as EAGLE does. The drafter's params
ARE the policy's params (the MTP module lives inside the decoder): pass the same state twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.eagle3 import ChainDrafter
from specjax.models import chunked
from specjax.models.config import ModelConfig
from specjax.models.decoder import Decoder
from specjax.models.losses import masked_cross_entropy
from specjax.drafters.methods import (DraftInit, DraftLossInputs, DraftMethodBase, OfflineDraft,
                                      register_method)


@dataclasses.dataclass(frozen=True)
class MtpDrafter(ChainDrafter):
  """Drafts with `Decoder.mtp_forward`; params are the decoder's state (graphdef: the decoder's)."""

  model_cfg: ModelConfig | None = None

  def __post_init__(self):
    super().__post_init__()
    if self.model_cfg is None or not self.model_cfg.mtp:
      raise ValueError("MtpDrafter.model_cfg: required, with mtp=True")

  def _model(self, params) -> Decoder:
    return nnx.merge(self.graphdef, params)

  def features(self, params, step):
    return step.out.hidden

  def run(self, params, hidden, tokens, cache):
    out = self._model(params).mtp_forward(hidden, tokens, cache=cache, compute_logits=False)
    return out.hidden, out.cache

  def draft_logits(self, params, hidden):
    model = self._model(params)
    return model.head(hidden[:, None], model.mtp.final_norm)[:, 0]

  def cache_spec(self):
    c = self.model_cfg
    return c.num_kv_heads, c.head_dim, c.compute_dtype

  def page_layout(self, params):
    return (1,) + self.cache_spec()

  def hidden_size(self):
    return self.model_cfg.hidden_size


def mtp_drafter(model: Decoder, *, draft_len: int,
                temperature: float = 1.0) -> tuple[MtpDrafter, nnx.State]:
  """(drafter, params) for a decoder with an MTP module; params are the decoder's own state."""
  graphdef, state = nnx.split(model)
  return MtpDrafter(draft_len=draft_len, vocab_size=model.cfg.vocab_size, temperature=temperature,
                    graphdef=graphdef, model_cfg=model.cfg), state


def mtp_loss(model: Decoder, hidden: jax.Array, tokens: jax.Array, loss_mask: jax.Array, *,
             stop_trunk_gradient: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Cross-entropy of the MTP module on token t + 2 from (hidden[t], tokens[t + 1]).

  `hidden` is the decoder's output [B, T, d] on `tokens`; `loss_mask[b, j]` marks tokens to learn
  (completion tokens). With `stop_trunk_gradient` only the MTP module learns: the trunk and the
  shared embedding / LM head get exactly zero gradient (the RL setting: the policy gradient stays
  what it is); without it they learn too (DeepSeek-V3).
  """
  if stop_trunk_gradient:
    hidden = jax.lax.stop_gradient(hidden)
    # the embedding and LM head the module shares with the policy must not learn either
    graphdef, own, shared = nnx.split(model, nnx.PathContains("mtp"), ...)
    model = nnx.merge(graphdef, own, jax.lax.stop_gradient(shared))
  chunk = model.cfg.logits_chunk
  out = model.mtp_forward(hidden[:, :-1], tokens[:, 1:], compute_logits=not chunk)
  if chunk:  # logits a chunk of positions at a time (ModelConfig.logits_chunk)
    h = model.mtp.final_norm(out.hidden[:, :-1])
    lp, _ = chunked.token_logprobs(h, model.head_weight(), tokens[:, 2:], chunk=chunk)
    mask = loss_mask[:, 2:].astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    hit = chunked.chunk_map(lambda hc, yc: jnp.argmax(chunked.head_logits(hc, model.head_weight()),
                                                      -1) == yc, (h, tokens[:, 2:]),
                            h.shape[1], chunk)
    loss, acc = -jnp.sum(lp * mask) / count, jnp.sum(hit.astype(jnp.float32) * mask) / count
  else:
    loss, acc = masked_cross_entropy(out.logits[:, :-1], tokens[:, 2:], loss_mask[:, 2:])
  return loss, {"mtp_loss": loss, "mtp_acc": acc}


def split_mtp(policy_state) -> tuple[Any, Any]:
  """(trunk, mtp) parts of a decoder state with an MTP module: the "policy" and "draft" groups
  of an online-MTP run. `nnx.merge_state(trunk, mtp)` is the full state again."""
  mtp, trunk = nnx.split_state(policy_state, nnx.PathContains("mtp"), ...)
  return trunk, mtp


@dataclasses.dataclass(frozen=True)
class MtpMethod(DraftMethodBase):
  """`mtp`: the policy's own MTP module drafts. It is split off the policy state into the "draft"
  group (so it can learn online from `mtp_loss` on the policy's hidden states) and merged back for
  every policy forward; the drafter's params are the policy state the sampler runs."""

  name: ClassVar[str] = "mtp"

  def init(self, draft_cfg, *, policy_cfg, policy_params, draft, draft_maps, seed):
    trunk, mtp = split_mtp(policy_params)
    return DraftInit(policy=trunk, draft=mtp, draft_obj=draft)

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft, group_size):
    if not policy_cfg.mtp:
      raise ValueError("DraftConfig.kind='mtp' needs a policy with an MTP module (ModelConfig.mtp)")
    return MtpDrafter(draft_len=draft_cfg.draft_len, vocab_size=policy_cfg.vocab_size,
                      graphdef=policy_graphdef, model_cfg=policy_cfg), None

  def forward_params(self, params):
    return nnx.merge_state(params["policy"], params["draft"])

  def sampler_params(self, params, policy, draft_aux, fixed):
    return policy

  @property
  def online_loss(self):
    return _mtp_online_loss

  def policy_overrides(self, draft_cfg, policy_dir):
    return {"mtp": True}

  def offline_draft(self, draft_cfg, policy, env):
    if checkpoint_has_mtp(env.policy_dir, policy.cfg):
      env.log(f"[draft] MTP module imported from {env.policy_dir}")
      return OfflineDraft(policy=policy)
    env.log(f"[draft] {env.policy_dir} ships no MTP weights: the MTP module is initialised and "
            "trained offline on the policy's rollouts (trunk frozen) before RL")
    return OfflineDraft(policy=env.train_mtp(policy))


def checkpoint_has_mtp(path: str, cfg: ModelConfig) -> bool:
  """Whether the Hugging Face directory `path` ships MTP weights (any layout `load_pretrained`
  reads) for a decoder of config `cfg`."""
  from specjax.models.hf import detect_mtp_layout
  from specjax.models.tensor_sources import tensor_files

  return detect_mtp_layout(tensor_files(path), cfg) is not None


def _mtp_online_loss(x: DraftLossInputs):
  sg = jax.lax.stop_gradient
  # the trunk (embedding, LM head) enters only under stop_gradient
  frozen = nnx.merge(x.policy_graphdef, sg(x.params["policy"]), x.params["draft"])
  loss, metrics = mtp_loss(frozen, sg(x.out.hidden), x.tokens, x.mask)
  return loss, {**metrics, "loss": loss}


register_method(MtpMethod())
