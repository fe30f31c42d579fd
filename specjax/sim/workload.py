"""What one RL step generates: batch, prompt and response lengths, and how drafts are accepted.

Response lengths follow a lognormal clipped at the max length (truncated rollouts pile up there).
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import numpy as np

from specjax.config_tree import refuse
from specjax.sim.catalog import UnknownName

_NORMAL = NormalDist()


def _check(cond: bool, field: str, msg: str) -> None:
  if not cond:
    refuse(f"Workload.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class Workload:
  """One GRPO step: `prompts` x `samples` rollouts. Acceptance: drafts are accepted with a
  per-position conditional rate `rate_i = first_rate * decay**(i-1)`; `acceptance_length` (vLLM
  convention, bonus token included) at `acceptance_at` draft tokens fixes `first_rate`."""

  name: str = "custom"
  prompts: int = 256
  samples: int = 16
  prompt_len: int = 256
  mean_response_len: float = 4000.0  # mean of the clipped distribution
  max_response_len: int = 16384
  length_sigma: float = 0.9  # lognormal shape: larger is more long-tailed
  acceptance_length: float = 2.5  # EAGLE-3 at `acceptance_at` draft tokens
  acceptance_at: int = 3
  acceptance_decay: float = 0.8
  ngram_acceptance_length: float = 2.1  # n-gram lookup at `acceptance_at` draft tokens

  def __post_init__(self):
    for f in ("prompts", "samples", "prompt_len", "max_response_len", "acceptance_at"):
      _check(getattr(self, f) >= 1, f, f"must be >= 1, got {getattr(self, f)}")
    _check(1 <= self.mean_response_len < self.max_response_len, "mean_response_len",
           f"must be in [1, max_response_len={self.max_response_len}), got "
           f"{self.mean_response_len}")
    _check(self.length_sigma > 0, "length_sigma", f"must be > 0, got {self.length_sigma}")
    for f in ("acceptance_length", "ngram_acceptance_length"):
      v = getattr(self, f)
      _check(1.0 <= v <= self.acceptance_at + 1, f,
             f"must be in [1, acceptance_at + 1 = {self.acceptance_at + 1}], got {v}")
    _check(0 < self.acceptance_decay <= 1, "acceptance_decay",
           f"must be in (0, 1], got {self.acceptance_decay}")

  @property
  def rollouts(self) -> int:
    return self.prompts * self.samples

  def replace(self, **kw) -> "Workload":
    return dataclasses.replace(self, **kw)

  def _log_median(self) -> float:
    return _solve_log_median(self.mean_response_len, self.length_sigma, self.max_response_len)

  def response_lengths(self, n: int) -> np.ndarray:
    """n response lengths at evenly spaced quantiles, sorted; deterministic (no sampling noise)."""
    q = (np.arange(n) + 0.5) / n
    return self.lengths_at(q)

  def lengths_at(self, q: np.ndarray) -> np.ndarray:
    mu, s = self._log_median(), self.length_sigma
    z = np.array([_NORMAL.inv_cdf(float(x)) for x in np.clip(q, 1e-12, 1 - 1e-12)])
    return np.clip(np.exp(mu + s * z), 1.0, self.max_response_len)

  def longest_response(self) -> float:
    """Expected longest of all rollouts of the step: the sampler waits for it."""
    return float(self.lengths_at(np.array([1.0 - 0.5 / self.rollouts]))[0])

  def first_rate(self, acceptance_length: float | None = None) -> float:
    return rate_for_acceptance(acceptance_length or self.acceptance_length, self.acceptance_at,
                               self.acceptance_decay)

  def acceptance_at_len(self, draft_len: int, acceptance_length: float | None = None) -> float:
    """Acceptance length with `draft_len` drafts, from the per-position model."""
    if draft_len == 0:
      return 1.0
    return acceptance_from_rate(self.first_rate(acceptance_length), draft_len,
                                self.acceptance_decay)


def _clipped_mean(mu: float, s: float, cap: float) -> float:
  z = (math.log(cap) - mu) / s
  return (math.exp(mu + s * s / 2) * _NORMAL.cdf(z - s) + cap * (1 - _NORMAL.cdf(z)))


def _solve_log_median(mean: float, s: float, cap: float) -> float:
  lo, hi = -10.0, math.log(cap) + 10 * s
  for _ in range(100):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if _clipped_mean(mid, s, cap) < mean else (lo, mid)
  return 0.5 * (lo + hi)


def acceptance_from_rate(first_rate: float, draft_len: int, decay: float) -> float:
  """1 + sum_i prod_{j<=i} rate_j with rate_j = first_rate * decay**(j-1) (capped at 1)."""
  rates = np.minimum(1.0, first_rate * decay ** np.arange(draft_len))
  return float(1.0 + np.cumprod(rates).sum())


def rate_for_acceptance(acceptance_length: float, draft_len: int, decay: float) -> float:
  """The first-position rate giving `acceptance_length` with `draft_len` drafts (bisection)."""
  if not 1.0 <= acceptance_length <= draft_len + 1:
    raise ValueError(f"acceptance_length must be in [1, {draft_len + 1}] for draft_len="
                     f"{draft_len}, got {acceptance_length}")
  lo, hi = 0.0, 1.0 / decay ** max(draft_len - 1, 0)
  for _ in range(80):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if acceptance_from_rate(mid, draft_len, decay) < acceptance_length else (
        lo, mid)
  return 0.5 * (lo + hi)


# Presets representative of the paper's two Qwen3-8B workloads (assumptions, see SIMULATOR.md).
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload(name="rl-zero", mean_response_len=2500.0, acceptance_length=2.47),
    Workload(name="rl-think", mean_response_len=4000.0, acceptance_length=2.05),
)}


def get_workload(name: str) -> Workload:
  if name not in WORKLOADS:
    raise UnknownName(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
  return WORKLOADS[name]
