"""The decoder's native MTP module as a drafter, its loss (token t + 2), and a small LM(+MTP) trainer.

K = 1 per module; K > 1 feeds the module its own output state, as EAGLE does. The drafter's params
ARE the policy's params (the MTP module lives inside the decoder): pass the same state twice.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from specjax.eagle.drafter import ChainDrafter
from specjax.eagle.train import make_optimizer
from specjax.models.config import ModelConfig
from specjax.models.decoder import Decoder


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

  def hidden_size(self):
    return self.model_cfg.hidden_size

  def num_draft_ids(self):
    return self.model_cfg.vocab_size


def mtp_drafter(model: Decoder, *, draft_len: int,
                temperature: float = 1.0) -> tuple[MtpDrafter, nnx.State]:
  """(drafter, params) for a decoder with an MTP module; params are the decoder's own state."""
  graphdef, state = nnx.split(model)
  return MtpDrafter(draft_len=draft_len, vocab_size=model.cfg.vocab_size, temperature=temperature,
                    graphdef=graphdef, model_cfg=model.cfg), state


def _masked_ce(logits, labels, mask):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  count = jnp.maximum(mask.sum(), 1.0)
  acc = (jnp.argmax(logp, -1) == labels).astype(jnp.float32)
  return jnp.sum(nll * mask) / count, jnp.sum(acc * mask) / count


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
  out = model.mtp_forward(hidden[:, :-1], tokens[:, 1:])
  loss, acc = _masked_ce(out.logits[:, :-1], tokens[:, 2:], loss_mask[:, 2:])
  return loss, {"mtp_loss": loss, "mtp_acc": acc}


def lm_mtp_loss(model: Decoder, tokens: jax.Array, loss_mask: jax.Array, *,
                mtp_weight: float = 0.3) -> tuple[jax.Array, dict[str, jax.Array]]:
  """LM cross-entropy (token t + 1) + mtp_weight * MTP cross-entropy (token t + 2), one forward;
  the MTP term trains the trunk too. Without an MTP module, the LM loss alone."""
  out = model(tokens)
  lm, acc = _masked_ce(out.logits[:, :-1], tokens[:, 1:], loss_mask[:, 1:])
  metrics = {"lm_loss": lm, "lm_acc": acc}
  if model.mtp is None or mtp_weight == 0:
    return lm, metrics
  mtp, mtp_metrics = mtp_loss(model, out.hidden, tokens, loss_mask, stop_trunk_gradient=False)
  return lm + mtp_weight * mtp, {**metrics, **mtp_metrics}


@dataclasses.dataclass(frozen=True)
class LmTrainConfig:
  steps: int = 500
  batch_size: int = 32
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  final_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  mtp_weight: float = 0.3  # joint training; ignored with mtp_only
  mtp_only: bool = False  # train the MTP module alone on a frozen trunk
  seed: int = 0

  def __post_init__(self):
    def check(cond, field, msg):
      if not cond:
        raise ValueError(f"LmTrainConfig.{field}: {msg}")

    check(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
    check(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
    check(self.learning_rate > 0, "learning_rate", f"must be > 0, got {self.learning_rate}")
    check(0 <= self.warmup_steps < self.steps, "warmup_steps",
          f"must lie in [0, steps={self.steps}), got {self.warmup_steps}")
    check(0 <= self.final_lr_ratio <= 1, "final_lr_ratio",
          f"must lie in [0, 1], got {self.final_lr_ratio}")
    check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
    check(self.clip_norm > 0, "clip_norm", f"must be > 0, got {self.clip_norm}")
    check(self.mtp_weight >= 0, "mtp_weight", f"must be >= 0, got {self.mtp_weight}")


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def lm_train_step(graphdef, cfg: LmTrainConfig, trained, frozen, opt_state, tokens, loss_mask):
  """One step on the `trained` part of the decoder's state (all params, or the MTP module's)."""

  def loss_fn(p):
    model = nnx.merge(graphdef, p, frozen)
    if cfg.mtp_only:
      return mtp_loss(model, model(tokens, compute_logits=False).hidden, tokens, loss_mask)
    return lm_mtp_loss(model, tokens, loss_mask, mtp_weight=cfg.mtp_weight)

  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained)
  updates, opt_state = make_optimizer(cfg).update(grads, opt_state, trained)
  return optax.apply_updates(trained, updates), opt_state, dict(metrics, loss=loss)


def train_lm(model: Decoder, tokens, loss_mask, cfg: LmTrainConfig = LmTrainConfig(), *,
             progress: bool = True) -> tuple[Decoder, list[dict[str, float]]]:
  """Train on sequences `tokens[M, W]` (random minibatches); returns (new decoder, history).

  Joint: LM + mtp_weight * MTP on all params. `mtp_only`: the MTP module alone (offline MTP
  drafter training on target rollouts), the rest of the decoder unchanged."""
  if cfg.mtp_only and model.mtp is None:
    raise ValueError("train_lm: mtp_only needs a decoder with an MTP module (ModelConfig.mtp)")
  which = nnx.PathContains("mtp") if cfg.mtp_only else nnx.Param
  graphdef, trained, frozen = nnx.split(model, which, ...)
  opt_state = make_optimizer(cfg).init(trained)
  tokens, loss_mask = np.asarray(tokens, np.int32), np.asarray(loss_mask, bool)
  rng = np.random.default_rng(cfg.seed)
  history = []
  bar = tqdm(range(cfg.steps), desc="mtp" if cfg.mtp_only else "lm", disable=not progress)
  for _ in bar:
    idx = rng.choice(tokens.shape[0], size=cfg.batch_size, replace=tokens.shape[0] < cfg.batch_size)
    trained, opt_state, metrics = lm_train_step(graphdef, cfg, trained, frozen, opt_state,
                                                jnp.asarray(tokens[idx]), jnp.asarray(loss_mask[idx]))
    history.append(metrics)
    if progress:
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
  history = [{k: float(v) for k, v in h.items()} for h in jax.device_get(history)]
  return nnx.merge(graphdef, trained, frozen), history
