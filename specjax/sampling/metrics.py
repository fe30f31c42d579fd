"""Acceptance metrics of speculative decoding, with vLLM's conventions (DESIGN.md).

`AcceptanceCounts` accumulates in-jit (a pytree of int32 counters, per row or pooled);
`AcceptanceMetrics` is its host-side summary: acceptance length, rate and per-position rates.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class AcceptanceCounts:
  """Counters over verify steps. A draft is one live row in one step (K proposed tokens).

  num_drafts: int32[] or int32[B] (per row); accepted_per_position: int32[K] or int32[B, K],
  whose [..., i] counts drafts with their first i+1 tokens all accepted. The accepted tokens are
  the sum over positions: a draft with n accepted contributes 1 to positions 0..n-1.
  """

  num_drafts: jax.Array
  accepted_per_position: jax.Array

  @classmethod
  def zeros(cls, draft_len: int, batch: int | None = None) -> "AcceptanceCounts":
    """Pooled counters (batch None) or one set per row (batch B)."""
    if draft_len < 1:
      raise ValueError(f"draft_len must be >= 1, got {draft_len}")
    lead = () if batch is None else (batch,)
    return cls(num_drafts=jnp.zeros(lead, jnp.int32),
               accepted_per_position=jnp.zeros(lead + (draft_len,), jnp.int32))

  @property
  def draft_len(self) -> int:
    return self.accepted_per_position.shape[-1]

  def update(self, num_accepted: jax.Array, live: jax.Array | None = None) -> "AcceptanceCounts":
    """Add one verify step: num_accepted int32[B] (0..K), live bool[B] (rows that drafted)."""
    num_accepted = jnp.asarray(num_accepted, jnp.int32)
    live = (jnp.ones(num_accepted.shape, jnp.int32) if live is None
            else jnp.asarray(live).astype(jnp.int32))
    hits = (num_accepted[:, None] > jnp.arange(self.draft_len)).astype(jnp.int32) * live[:, None]
    if self.num_drafts.ndim == 0:
      return AcceptanceCounts(self.num_drafts + live.sum(),
                              self.accepted_per_position + hits.sum(0))
    return AcceptanceCounts(self.num_drafts + live, self.accepted_per_position + hits)

  def pooled(self) -> "AcceptanceCounts":
    """Sum per-row counters over rows (no-op when already pooled)."""
    if self.num_drafts.ndim == 0:
      return self
    return AcceptanceCounts(self.num_drafts.sum(), self.accepted_per_position.sum(0))

  def __add__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
    return AcceptanceCounts(self.num_drafts + other.num_drafts,
                            self.accepted_per_position + other.accepted_per_position)


def count_acceptance(num_accepted: jax.Array, live: jax.Array | None,
                     draft_len: int) -> AcceptanceCounts:
  """Pooled counts from a whole run: num_accepted int32[steps, B], live bool[steps, B]."""
  num_accepted = jnp.asarray(num_accepted, jnp.int32)
  if num_accepted.ndim != 2:
    raise ValueError(f"num_accepted must be [steps, B], got shape {num_accepted.shape}")
  if live is None:
    live = jnp.ones(num_accepted.shape, bool)
  live = jnp.asarray(live)
  if live.shape != num_accepted.shape:
    raise ValueError(f"live {live.shape} must match num_accepted {num_accepted.shape}")
  counts = AcceptanceCounts.zeros(draft_len)
  return counts.update(num_accepted.reshape(-1), live.reshape(-1))


@dataclasses.dataclass(frozen=True)
class AcceptanceMetrics:
  """Host-side acceptance statistics (vLLM conventions); NaN where there were no drafts."""

  draft_len: int
  num_drafts: int
  num_draft_tokens: int
  num_accepted_tokens: int
  accepted_per_position: tuple[int, ...]

  @classmethod
  def from_counts(cls, counts: AcceptanceCounts) -> "AcceptanceMetrics":
    counts = jax.device_get(counts.pooled())
    per_position = tuple(int(c) for c in np.asarray(counts.accepted_per_position))
    num_drafts = int(counts.num_drafts)
    return cls(draft_len=len(per_position), num_drafts=num_drafts,
               num_draft_tokens=num_drafts * len(per_position),
               num_accepted_tokens=sum(per_position), accepted_per_position=per_position)

  @property
  def acceptance_length(self) -> float:
    """Mean tokens emitted per draft: 1 + accepted / drafts (the 1 is the bonus/correction)."""
    return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

  @property
  def acceptance_rate(self) -> float:
    """Accepted / drafted tokens."""
    if not self.num_draft_tokens:
      return math.nan
    return self.num_accepted_tokens / self.num_draft_tokens

  @property
  def per_position_acceptance_rate(self) -> tuple[float, ...]:
    """At i: drafts whose first i+1 tokens were all accepted / drafts."""
    if not self.num_drafts:
      return (math.nan,) * self.draft_len
    return tuple(c / self.num_drafts for c in self.accepted_per_position)

  def summary(self) -> dict:
    return {
      "draft_len": self.draft_len,
      "num_drafts": self.num_drafts,
      "num_draft_tokens": self.num_draft_tokens,
      "num_accepted_tokens": self.num_accepted_tokens,
      "acceptance_length": self.acceptance_length,
      "acceptance_rate": self.acceptance_rate,
      "per_position_acceptance_rate": list(self.per_position_acceptance_rate),
    }


def acceptance_metrics(num_accepted, live, draft_len: int) -> AcceptanceMetrics:
  """Metrics of a run from per-step accepted counts [steps, B] and live-row masks [steps, B]."""
  return AcceptanceMetrics.from_counts(count_acceptance(num_accepted, live, draft_len))


def tokens_per_second(num_tokens, seconds: float) -> float:
  """Throughput of a whole generate call: generated tokens (a count, or a per-row lengths or
  completion-mask array, summed) over wall-clock seconds."""
  if not seconds > 0:
    raise ValueError(f"seconds must be > 0, got {seconds}")
  return float(np.sum(np.asarray(jax.device_get(num_tokens), np.float64))) / seconds
