"""The packed train step: a rollout batch's sequences laid end to end in rows (`rl.packing`), their
gradients summed over micro-batches of one shape (one compiled program), then one update.
`trainer` below is the run's `train_step.Trainer` (not imported: it imports this module).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax.rl.grpo import denominators
from specjax.rl.train_state import TrainBatch, TrainState

# metrics that are means over the trained completion tokens (none when a step trains on none)
TOKEN_MEAN_METRICS = frozenset({"entropy", "kl", "clip_frac", "clip_low_frac", "clip_high_frac",
                                "ratio_mean", "approx_kl_old", "mismatch/mean_abs",
                                "mismatch/max_abs"})

def accumulate_metric(name: str, acc: jax.Array, value: jax.Array) -> jax.Array:
  """Micro-batch metrics add up (they are scaled like the loss), maxima take the max."""
  return jnp.maximum(acc, value) if name.endswith("max_abs") else acc + value


def packed_step(trainer, state: TrainState, batch: TrainBatch, draft_weight,
                donate: bool) -> tuple[TrainState, dict]:
  """One optimizer step on `batch` packed: gradients summed over its micro-batches of
  [pack_rows, width] (one compiled program whatever the batch's lengths), then one update; the
  same step as on the padded batch, up to float summation order.

  With `skip_zero_advantage` the sequences whose advantages are all exactly 0 are left out of
  the packing (their gradient is exactly 0; the loss keeps the whole batch's denominators);
  when that leaves nothing, the update applies zero gradients (AdamW's moments and weight
  decay still move, as in the full step) and the token-mean metrics are left out."""
  from specjax.rl.packing import attention_work, pack

  c = trainer.step_cfg
  if batch.positions is not None:
    raise ValueError("Trainer.step: the batch is packed already; pass the [B, S] batch")
  host = jax.device_get(batch)
  mask = np.asarray(host.loss_mask, np.float32)
  denom = denominators(jnp.asarray(mask), c.loss_norm_len)
  width = c.pack_width or host.tokens.shape[1]
  fields = {f.name: getattr(host, f.name) for f in dataclasses.fields(TrainBatch)
            if f.name not in ("positions", "segment_ids", "seq_lengths")}
  has_tokens = mask.sum(axis=1) > 0
  skipped = np.zeros(mask.shape[0], bool)
  if c.skip_zero_advantage:  # advantages [B]: one per row (the batch is unpacked)
    skipped = (np.asarray(host.advantages, np.float32) == 0.0) & has_tokens
    fields["loss_mask"] = np.where(skipped[:, None], 0.0, mask).astype(mask.dtype)
  # always set (one pytree structure, one compiled program, whether or not rows are left out)
  denom = denom.replace(metric_tokens=jnp.float32(max(fields["loss_mask"].sum(), 1.0)))
  micros = pack(fields, width, trainer.pack_rows)
  trained = bool(np.asarray(fields["loss_mask"]).any())
  acc = None
  for micro in micros:
    micro = trainer.place_batch(TrainBatch(**micro))
    if acc is None:  # committed like the sums: every micro-batch calls one program
      acc = _commit_acc(trainer, state, _zero_acc_jit(trainer, state, micro, draft_weight, denom))
    signature = (jax.tree.structure(micro),
                 tuple((x.shape, x.dtype) for x in jax.tree.leaves(micro)))
    if not trained and signature in trainer.accumulated:  # zero gradients
      break
    # (nothing to train the first time: one empty micro-batch compiles the program now, as
    # the run's first step must, so that no later step compiles)
    acc = _accumulate_jit(trainer, state, acc, micro, draft_weight, denom)
    trainer.accumulated.add(signature)
  new, metrics = trainer.apply_grads(state, acc[0], acc[1], draft_weight, donate=donate)
  if not trained:
    metrics = {k: v for k, v in metrics.items() if k not in TOKEN_MEAN_METRICS}
  if c.skip_zero_advantage:
    metrics["train/skipped_seqs"] = float(skipped.sum()) / max(int(has_tokens.sum()), 1)
  metrics["train/packed_rows"] = float(len(micros) * trainer.pack_rows if trained else 0)
  # for the step's model FLOPs: the trained sequences' positions and causal attention pairs
  metrics["train/tokens"], metrics["train/attention_pairs"] = \
      attention_work(fields["loss_mask"]) if trained else (0.0, 0.0)
  return new, metrics


def _accumulate_packed(trainer, state: TrainState, acc, batch: TrainBatch, draft_weight,
                       denom):
  """acc + (grads, metrics) of one packed micro-batch."""
  grads, metrics = trainer._grads(state, batch, draft_weight, denom)
  return _place_acc(trainer, state, (
      jax.tree.map(jnp.add, acc[0], grads),
      {k: accumulate_metric(k, acc[1][k], v) for k, v in metrics.items()}))


def _zero_acc(trainer, state: TrainState, batch: TrainBatch, draft_weight, denom):
  """Zeros shaped like `_accumulate_packed`'s (grads, metrics)."""
  shapes = jax.eval_shape(trainer._grads, state, batch, draft_weight, denom)
  return _place_acc(trainer, state, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))


def _acc_shardings(trainer, state: TrainState, acc):
  """(grads sharded like the params, metrics replicated): where the accumulated (grads,
  metrics) live on the mesh."""
  from specjax.sharding import state_shardings
  replicated = NamedSharding(trainer.mesh, P())
  return ({g: state_shardings(p, trainer.mesh) for g, p in state.params.items()},
          jax.tree.map(lambda _: replicated, acc[1]))


def _commit_acc(trainer, state: TrainState, acc):
  """`_zero_acc`'s output placed (committed) as `_accumulate_packed` returns it, so that the
  update reuses its compiled program."""
  if trainer.mesh is None:
    return jax.device_put(acc, jax.devices()[0])
  return jax.device_put(acc, _acc_shardings(trainer, state, acc))


def _place_acc(trainer, state: TrainState, acc):
  """Accumulated gradients sharded like the params (metrics replicated), so every micro-batch
  call sees the same input shardings and reuses one compiled program."""
  if trainer.mesh is None:
    return acc
  return jax.tree.map(jax.lax.with_sharding_constraint, acc,
                      _acc_shardings(trainer, state, acc))


_accumulate_jit = jax.jit(_accumulate_packed, static_argnums=0, donate_argnums=2)
_zero_acc_jit = jax.jit(_zero_acc, static_argnums=0)
