"""The frozen target's features on fixed rollouts, computed once for offline EAGLE-3 training.

The TTT loss (`ttt.py`) needs three things of the target at every position: the aux hidden
states (the head's input), the target's distribution restricted to the draft vocabulary and
renormalised (the soft label), and whether the target's full-vocabulary argmax is draftable (the
weight). The target is frozen during offline training, so these are the same at every step and
epoch; running its layers inside each step repeats that work (for a 30-layer target, most of a
step's cost).

What is stored (host memory, numpy), per rollout position:
  aux_hidden    [M, W, n_aux * d]  compute dtype: exactly what the target hands the head
  final_hidden  [M, W, d]          compute dtype: the final-normed hidden, the LM head's input
  argmax        int32[M, W]        the target's argmax over its full vocabulary
The soft label is recomputed per step as final_hidden @ W_lm[:, d2t] (the target's logits at the
draft ids, the same einsum the target's LM head runs, so equal up to float rounding); this costs
one d x N matmul per position that carries weight, a fraction of the head's own step, and stores
d values per position instead of N log-probs (N = 8192-32000 draft ids; float32 [M, W, N] is
gigabytes at a hundred rollouts). Argmax is stored rather than recomputed because it ranges over
all V ids.

The loss on features (`ttt_loss_from_features`) is `ttt_loss`'s, with the vocabulary-sized work
(both LM heads, softmaxes, cross-entropy) done only at the positions that can carry weight, the
completion tokens (`loss_positions`): the head's layer still runs at every position (the prompt
is its context), but in a padded batch of prompts and long-tailed completions, most [B, T, N]
logits that `ttt_loss` computes are multiplied by 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from specjax.drafters.head import Eagle3Head
from specjax.drafters.ttt import _head_step, _shift_left, step_terms
from specjax.drafters.vocab import VocabMaps


@dataclasses.dataclass
class TargetFeatures:
  """The frozen target's features on rollouts [M, W] (module docstring), on the host."""

  aux_hidden: np.ndarray  # [M, W, n_aux * d]
  final_hidden: np.ndarray  # [M, W, d]
  argmax: np.ndarray  # int32[M, W]

  @property
  def nbytes(self) -> int:
    return self.aux_hidden.nbytes + self.final_hidden.nbytes + self.argmax.nbytes

  def take(self, idx, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows `idx`, first `width` positions of each array."""
    return (self.aux_hidden[idx, :width], self.final_hidden[idx, :width],
            self.argmax[idx, :width])


def feature_nbytes(model_cfg, rows: int, width: int) -> int:
  """Host bytes `compute_features` will hold for `rows` rollouts of `width` positions."""
  per_value = np.dtype(model_cfg.compute_dtype).itemsize
  d = model_cfg.hidden_size
  per_position = (len(model_cfg.aux_layer_ids) + 1) * d * per_value + 4
  return rows * width * per_position


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _target_features(graphdef, params, tokens):
  model = nnx.merge(graphdef, params)
  out = model(tokens)
  final = model.final_norm(out.hidden).astype(model.cfg.compute_dtype)
  return out.aux_hidden, final, jnp.argmax(out.logits, axis=-1).astype(jnp.int32)


def compute_features(target, tokens, *, batch_size: int = 16,
                     progress: bool = False) -> TargetFeatures:
  """Run the target (a (graphdef, params) pair) once over `tokens` int32[M, W] in batches of
  `batch_size` rows (the last wraps around, so one program is compiled); features on the host."""
  graphdef, params = target
  tokens = np.asarray(tokens, np.int32)
  m = tokens.shape[0]
  batch = min(batch_size, m)
  parts = []
  for start in tqdm(range(0, m, batch), desc="target features", disable=not progress):
    idx = np.arange(start, start + batch) % m
    keep = min(batch, m - start)
    out = jax.device_get(_target_features(graphdef, params, jnp.asarray(tokens[idx])))
    parts.append([np.asarray(x)[:keep] for x in out])
  aux, final, argmax = (np.concatenate(p) for p in zip(*parts))
  return TargetFeatures(aux_hidden=aux, final_hidden=final, argmax=argmax)


def _ttt_hidden(head: Eagle3Head, embed_table: jax.Array, aux_hidden: jax.Array,
                tokens: jax.Array, num_steps: int, block: int = 512) -> list[jax.Array]:
  """Pre-norm outputs [B, T, d] of every unrolled step, as `ttt_loss_chunked` computes them
  (blockwise attention: causal over the step-0 keys, plus the chain's own keys at t; equal to
  `ttt_forward`'s masked attention over all steps' keys, at a third of its scores)."""
  b, t = tokens.shape
  h = head.fuse(jax.lax.stop_gradient(aux_hidden))
  keys, out = [], []
  for i in range(num_steps):
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + i, (b, t))
    h, keys = _head_step(head, embed_table, h, _shift_left(tokens, 1 + i), positions, keys, block)
    out.append(h)
  return out


def loss_positions(loss_mask: np.ndarray, num_steps: int,
                   buckets: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(rows, cols, valid) int32/int32/bool[K]: the positions t at which some unrolled step can
  carry weight (loss_mask[t + 2 + i] for some step i), padded to K, a multiple of
  max(8, B * T / `buckets`) (a few compiled sizes); padding is (0, 0, False)."""
  b, t = loss_mask.shape
  need = np.zeros((b, t), bool)
  for i in range(num_steps):
    need[:, :max(t - 2 - i, 0)] |= loss_mask[:, 2 + i:]
  rows, cols = np.nonzero(need)
  multiple = max(8, -(-b * t // buckets))
  k = min(b * t, max(multiple, -(-rows.size // multiple) * multiple))
  pad = k - rows.size
  valid = np.arange(k) < rows.size
  return (np.pad(rows, (0, pad)).astype(np.int32), np.pad(cols, (0, pad)).astype(np.int32), valid)


def ttt_loss_from_features(head_graphdef: nnx.GraphDef, head_params: nnx.State,
                           embed_table: jax.Array, lm_head: jax.Array, aux_hidden: jax.Array,
                           final_hidden: jax.Array, target_argmax: jax.Array, tokens: jax.Array,
                           loss_mask: jax.Array, maps: VocabMaps, positions, *,
                           num_steps: int = 3, step_decay: float = 0.8):
  """`ttt_loss` on precomputed target features; `lm_head` [d, V] is the target's, `positions`
  `loss_positions(loss_mask, num_steps)`.

  The same sums as `ttt_loss` (soft labels: the target's logits at the draft ids, rebuilt from
  `final_hidden`, renormalised; weights: step_decay**i * loss_mask[t + 2 + i] * t2d[argmax]),
  with the head's and the target's draft-vocabulary logits computed only at `positions`: every
  other position has weight 0 at every step, and those [B, T, N] logits are most of the cost."""
  head = nnx.merge(head_graphdef, head_params)
  rows, cols, valid = (jnp.asarray(x) for x in positions)
  final_hidden, loss_mask = jnp.asarray(final_hidden), jnp.asarray(loss_mask, jnp.bool_)
  t = tokens.shape[1]
  dt = final_hidden.dtype
  w = jnp.take(jax.lax.stop_gradient(lm_head), maps.d2t, axis=1).astype(dt)
  draftable = jnp.take(maps.t2d, target_argmax)
  hidden = _ttt_hidden(head, embed_table, aux_hidden, tokens, num_steps)
  total = jnp.zeros((), jnp.float32)
  metrics = {}
  for i, h in enumerate(hidden):
    label_at = jnp.minimum(cols + 1 + i, t - 1)  # the target's distribution of token t + 2 + i
    weight_at = cols + 2 + i
    weight = (valid & (weight_at < t) & loss_mask[rows, jnp.minimum(weight_at, t - 1)]
              & draftable[rows, label_at]).astype(jnp.float32)
    target = jnp.einsum("kd,dn->kn", jax.lax.stop_gradient(final_hidden[rows, label_at]), w,
                        preferred_element_type=jnp.float32)
    target_logp = jax.nn.log_softmax(target, axis=-1)
    draft_logp = jax.nn.log_softmax(head.logits(h[rows, cols]), axis=-1)
    ce = -jnp.sum(jnp.exp(target_logp) * draft_logp, axis=-1)
    agree = (jnp.argmax(draft_logp, -1) == jnp.argmax(target_logp, -1)).astype(jnp.float32)
    total = total + step_terms(metrics, i, ce, agree, weight, step_decay)
  metrics["loss"] = total
  return total, metrics


def batch_width(loss_mask: np.ndarray, buckets: int = 4) -> int:
  """Positions a batch needs: through its last completion token, rounded up to one of `buckets`
  widths (multiples of max(8, W / buckets): a few compiled programs), at most the rollouts' W.
  Exact: the TTT loss at position t reads positions <= t + 2 + step only, and positions after
  the last completion token carry no weight."""
  full = loss_mask.shape[1]
  multiple = max(8, -(-full // buckets))
  cols = np.flatnonzero(loss_mask.any(axis=0))
  need = int(cols[-1]) + 1 if cols.size else 1
  return min(full, -(-need // multiple) * multiple)
