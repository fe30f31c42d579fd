"""Supervised LM training (+ the MTP module's loss when the model has one): `train_lm` on token
arrays, and `pretrain_lm` on texts, which builds the base policies of the RL runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from specjax.config_tree import check
from specjax.drafters.mtp import mtp_loss
from specjax.models.decoder import Decoder
from specjax.models.losses import masked_cross_entropy
from specjax.optim import check_trainer_fields, trainer_transform


def encode_sft(tokenizer, examples: Sequence[str | tuple[str, str]],
               width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32[M, W], loss mask bool[M, W]) of BOS + text + EOS rows, right-padded.

  A plain string is learned whole; a (prompt, completion) pair learns only the completion and
  its EOS. The mask marks tokens to predict (mask[b, j]: learn token j)."""
  rows, masks = [], []
  bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
  for ex in examples:
    prompt, completion = ("", ex) if isinstance(ex, str) else ex
    p = bos + tokenizer.encode(prompt)
    c = tokenizer.encode(completion, eos=True)
    rows.append(p + c)
    masks.append([False] * len(p) + [True] * len(c))
  w = width or max(len(r) for r in rows)
  if any(len(r) > w for r in rows):
    raise ValueError(f"encode_sft: an example has {max(len(r) for r in rows)} tokens > width {w}")
  tokens = np.full((len(rows), w), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(rows), w), bool)
  for i, (r, m) in enumerate(zip(rows, masks)):
    tokens[i, :len(r)] = r
    mask[i, :len(m)] = m
  return tokens, mask


def pretrain_lm(model: Decoder, examples: Sequence[str | tuple[str, str]], tokenizer, *,
                steps: int = 300, batch_size: int = 64, lr: float = 3e-3,
                warmup_steps: int | None = None, weight_decay: float = 0.0, seed: int = 0,
                mtp_weight: float = 0.3, length_batches: bool = False,
                progress: bool = False) -> tuple[Decoder, list[dict[str, float]]]:
  """Supervised fine-tuning of `model` on texts or (prompt, completion) pairs; returns the trained
  decoder (a new module) and the per-step loss history. warmup_steps None:
  `specjax.optim.default_warmup(steps)`."""
  tokens, mask = encode_sft(tokenizer, examples)
  cfg = LmTrainConfig(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps,
                      weight_decay=weight_decay, mtp_weight=mtp_weight,
                      length_batches=length_batches, seed=seed)
  return train_lm(model, tokens, mask, cfg, progress=progress)


def lm_mtp_loss(model: Decoder, tokens: jax.Array, loss_mask: jax.Array, *,
                mtp_weight: float = 0.3) -> tuple[jax.Array, dict[str, jax.Array]]:
  """LM cross-entropy (token t + 1) + mtp_weight * MTP cross-entropy (token t + 2), one forward;
  the MTP term trains the trunk too. Without an MTP module, the LM loss alone."""
  out = model(tokens)
  lm, acc = masked_cross_entropy(out.logits[:, :-1], tokens[:, 1:], loss_mask[:, 1:])
  metrics = {"lm_loss": lm, "lm_acc": acc}
  if model.mtp is None or mtp_weight == 0:
    return lm, metrics
  mtp, mtp_metrics = mtp_loss(model, out.hidden, tokens, loss_mask, stop_trunk_gradient=False)
  return lm + mtp_weight * mtp, {**metrics, **mtp_metrics}


@dataclasses.dataclass(frozen=True)
class LmTrainConfig:
  steps: int = 500
  batch_size: int = 32
  lr: float = 3e-3
  warmup_steps: int | None = None  # None: specjax.optim.default_warmup(steps)
  final_lr_ratio: float = 0.1  # cosine decays to lr * final_lr_ratio
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  mtp_weight: float = 0.3  # joint training; ignored with mtp_only
  mtp_only: bool = False  # train the MTP module alone on a frozen trunk
  # minibatches of rows of similar length (a random window of the rows sorted by length), each
  # cut to its own width: long-tailed texts then cost their mean length, not their longest
  length_batches: bool = False
  seed: int = 0

  def __post_init__(self):
    w = "LmTrainConfig"
    check_trainer_fields(self, w)
    check(self.mtp_weight >= 0, f"{w}.mtp_weight", f"must be >= 0, got {self.mtp_weight}")


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def lm_train_step(graphdef, cfg: LmTrainConfig, trained, frozen, opt_state, tokens, loss_mask):
  """One step on the `trained` part of the decoder's state (all params, or the MTP module's)."""

  def loss_fn(p):
    model = nnx.merge(graphdef, p, frozen)
    if cfg.mtp_only:
      return mtp_loss(model, model(tokens, compute_logits=False).hidden, tokens, loss_mask)
    return lm_mtp_loss(model, tokens, loss_mask, mtp_weight=cfg.mtp_weight)

  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained)
  updates, opt_state = trainer_transform(cfg).update(grads, opt_state, trained)
  return optax.apply_updates(trained, updates), opt_state, dict(metrics, loss=loss)


WIDTH_QUANTUM = 64


def _row_lengths(loss_mask: np.ndarray) -> np.ndarray:
  """Index after each row's last learned token."""
  m = np.asarray(loss_mask, bool)
  return np.where(m.any(axis=1), m.shape[1] - np.argmax(m[:, ::-1], axis=1), 0)


def batch_width(loss_mask: np.ndarray, width: int) -> int:
  """Columns a minibatch needs: its last learned token, rounded up to WIDTH_QUANTUM (few compiled
  shapes). Long-tailed texts (the trace task's scratchpads) then cost their own length, not the
  longest row's: the zero-mask tail adds nothing to the masked loss."""
  used = np.flatnonzero(loss_mask.any(axis=0))
  last = int(used[-1]) + 1 if used.size else 1
  return min(width, -(-last // WIDTH_QUANTUM) * WIDTH_QUANTUM)


def train_lm(model: Decoder, tokens, loss_mask, cfg: LmTrainConfig = LmTrainConfig(), *,
             progress: bool = True) -> tuple[Decoder, list[dict[str, float]]]:
  """Train on sequences `tokens[M, W]` (random minibatches); returns (new decoder, history).

  Joint: LM + mtp_weight * MTP on all params. `mtp_only`: the MTP module alone (offline MTP
  drafter training on target rollouts), the rest of the decoder unchanged."""
  if cfg.mtp_only and model.mtp is None:
    raise ValueError("train_lm: mtp_only needs a decoder with an MTP module (ModelConfig.mtp)")
  which = nnx.PathContains("mtp") if cfg.mtp_only else nnx.Param
  graphdef, trained, frozen = nnx.split(model, which, ...)
  opt_state = trainer_transform(cfg).init(trained)
  tokens, loss_mask = np.asarray(tokens, np.int32), np.asarray(loss_mask, bool)
  rng = np.random.default_rng(cfg.seed)
  by_length = np.argsort(_row_lengths(loss_mask), kind="stable")
  history = []
  bar = tqdm(range(cfg.steps), desc="mtp" if cfg.mtp_only else "lm", disable=not progress)
  for _ in bar:
    if cfg.length_batches and tokens.shape[0] > cfg.batch_size:
      start = int(rng.integers(0, tokens.shape[0] - cfg.batch_size + 1))
      idx = by_length[start:start + cfg.batch_size]
    else:
      idx = rng.choice(tokens.shape[0], size=cfg.batch_size,
                       replace=tokens.shape[0] < cfg.batch_size)
    w = batch_width(loss_mask[idx], tokens.shape[1])
    trained, opt_state, metrics = lm_train_step(graphdef, cfg, trained, frozen, opt_state,
                                                jnp.asarray(tokens[idx, :w]),
                                                jnp.asarray(loss_mask[idx, :w]))
    history.append(metrics)
    if progress:
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
  history = [{k: float(v) for k, v in h.items()} for h in jax.device_get(history)]
  return nnx.merge(graphdef, trained, frozen), history
