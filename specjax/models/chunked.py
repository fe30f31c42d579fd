"""Per-token statistics of an LM head computed in sequence chunks from hidden states.

Token logprobs, entropy and a soft cross-entropy against a teacher head, without [B, S, V] logits:
each chunk's logits live only inside a rematerialised scan body, forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
  """[B, S, ...] -> [n, B, chunk, ...], zero-padded at the end."""
  b, s = x.shape[:2]
  pad = -s % chunk
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape((b, -1, chunk) + x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _unchunk(x: jax.Array, seq: int) -> jax.Array:
  """[n, B, chunk, ...] -> [B, seq, ...]."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :seq]


def chunk_map(fn, xs: tuple[jax.Array, ...], seq: int, chunk: int):
  """fn over sequence chunks of each [B, S, ...] array in xs; fn's [B, chunk, ...] outputs are
  reassembled to [B, S, ...]. fn is rematerialised, so reverse mode keeps one chunk's internals."""
  chunk = max(1, min(int(chunk), seq)) if chunk else seq
  body = jax.checkpoint(lambda _, x: (None, fn(*x)), prevent_cse=False)
  _, out = jax.lax.scan(body, None, tuple(_chunks(x, chunk) for x in xs))
  return jax.tree.map(lambda y: _unchunk(y, seq), out)


def head_logits(hidden: jax.Array, weight: jax.Array) -> jax.Array:
  """float32 logits [..., V] of (already normalised) hidden states [..., d] and a head [d, V]."""
  dt = hidden.dtype
  return jnp.einsum("...d,dv->...v", hidden, weight.astype(dt), preferred_element_type=jnp.float32)


def logprob_and_entropy(logits: jax.Array, targets: jax.Array,
                        temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(logprob of targets, entropy) under softmax(logits / temperature); logits [..., V]."""
  x = logits.astype(jnp.float32)
  if temperature > 0 and temperature != 1.0:
    x = x / temperature
  logp = jax.nn.log_softmax(x, axis=-1)
  lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def token_logprobs(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *,
                   temperature: float = 1.0, chunk: int = 512) -> tuple[jax.Array, jax.Array]:
  """(logprob [B, S] of targets[b, s], entropy [B, S]) of softmax(hidden @ weight / temperature)
  for normalised hidden [B, S, d] and head weight [d, V]; `chunk` positions at a time (0: all)."""
  fn = lambda h, y: logprob_and_entropy(head_logits(h, weight), y, temperature)
  return chunk_map(fn, (hidden, targets), hidden.shape[1], chunk)


def soft_cross_entropy(student_hidden: jax.Array, student_weight: jax.Array,
                       teacher_hidden: jax.Array, teacher_weight: jax.Array,
                       teacher_ids: jax.Array | None = None, *,
                       chunk: int = 512) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per position [B, S]: (cross-entropy of the student's softmax against the teacher's, whether
  their argmaxes agree, the argmax of the teacher's full logits). The teacher's distribution is
  restricted to `teacher_ids` [N] (the student's vocabulary in teacher ids) and renormalised;
  the teacher enters under stop_gradient."""
  teacher_weight = jax.lax.stop_gradient(teacher_weight)

  def fn(hs, ht):
    full = head_logits(jax.lax.stop_gradient(ht), teacher_weight)
    sub = full if teacher_ids is None else jnp.take(full, teacher_ids, axis=-1)
    teacher_logp = jax.nn.log_softmax(sub, axis=-1)
    student_logp = jax.nn.log_softmax(head_logits(hs, student_weight), axis=-1)
    ce = -jnp.sum(jnp.exp(teacher_logp) * student_logp, axis=-1)
    agree = jnp.argmax(student_logp, -1) == jnp.argmax(teacher_logp, -1)
    return ce, agree.astype(jnp.float32), jnp.argmax(full, -1).astype(jnp.int32)

  return chunk_map(fn, (student_hidden, teacher_hidden), student_hidden.shape[1], chunk)
