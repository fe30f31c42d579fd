"""Statistical checks shared by the sampling tests: chi-square goodness of fit and two-sample tests.

Each `assert_*` runs one test at significance `alpha` (the probability of failing when the
distributions are equal) and raises AssertionError with the numbers when it rejects.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import stats as sps

# cells whose expected count is below this are pooled, so the chi-square approximation holds
MIN_EXPECTED = 5.0


@dataclasses.dataclass(frozen=True)
class StatResult:
  statistic: float  # chi-square statistic after pooling small cells
  dof: int
  pvalue: float  # 0 when a sample fell where the reference has probability 0
  total_variation: float  # between the empirical and reference distributions
  num_samples: int
  impossible: int  # samples in categories of probability 0 (goodness of fit only)

  def describe(self) -> str:
    return (f"chi2={self.statistic:.2f} dof={self.dof} p={self.pvalue:.3g} "
            f"TV={self.total_variation:.4f} n={self.num_samples} impossible={self.impossible}")


def bonferroni(alpha: float, num_tests: int) -> float:
  """Per-test level that keeps the family-wise false-failure rate of `num_tests` tests <= alpha."""
  return alpha / num_tests


def pair_index(first: np.ndarray, second: np.ndarray, num_categories: int) -> np.ndarray:
  """Category id of the pair (first, second) in a flattened [C, C] joint."""
  return np.asarray(first, np.int64) * num_categories + np.asarray(second, np.int64)


def _counts(samples: np.ndarray, num_categories: int) -> np.ndarray:
  samples = np.asarray(samples).reshape(-1).astype(np.int64)
  if samples.size and (samples.min() < 0 or samples.max() >= num_categories):
    raise ValueError(f"samples must lie in [0, {num_categories}), got range "
                     f"[{samples.min()}, {samples.max()}]")
  return np.bincount(samples, minlength=num_categories).astype(np.float64)


def _pool_small(expected: np.ndarray, *observed: np.ndarray):
  """Merge the cells with expected count < MIN_EXPECTED into one (into the smallest other cell
  if the pool itself stays small); returns the pooled expected and observed arrays."""
  small = expected < MIN_EXPECTED
  if not small.any():
    return (expected,) + observed
  big = np.flatnonzero(~small)
  exp_big = expected[big]
  obs_big = [o[big] for o in observed]
  pool_exp = expected[small].sum()
  pool_obs = [o[small].sum() for o in observed]
  if pool_exp < MIN_EXPECTED and big.size:
    j = int(np.argmin(exp_big))
    exp_big = exp_big.copy()
    exp_big[j] += pool_exp
    obs_big = [ob.copy() for ob in obs_big]
    for ob, po in zip(obs_big, pool_obs):
      ob[j] += po
    return (exp_big,) + tuple(obs_big)
  return ((np.append(exp_big, pool_exp),)
          + tuple(np.append(ob, po) for ob, po in zip(obs_big, pool_obs)))


def goodness_of_fit(samples: np.ndarray, probs: np.ndarray) -> StatResult:
  """Chi-square test that integer `samples` are i.i.d. draws from `probs[C]`."""
  probs = np.asarray(probs, np.float64).reshape(-1)
  if probs.min() < 0 or probs.sum() <= 0:
    raise ValueError("probs must be non-negative with positive mass")
  probs = probs / probs.sum()
  counts = _counts(samples, probs.size)
  n = counts.sum()
  tv = 0.5 * float(np.abs(counts / n - probs).sum())
  possible = probs > 0
  impossible = int(counts[~possible].sum())
  expected, observed = _pool_small(n * probs[possible], counts[possible])
  stat = float(np.sum((observed - expected) ** 2 / expected))
  dof = expected.size - 1
  pvalue = float(sps.chi2.sf(stat, dof)) if dof > 0 else 1.0
  if impossible:
    pvalue = 0.0
  return StatResult(stat, dof, pvalue, tv, int(n), impossible)


def two_sample(a: np.ndarray, b: np.ndarray, num_categories: int) -> StatResult:
  """Chi-square test of homogeneity: are integer samples `a` and `b` from one distribution?"""
  ca, cb = _counts(a, num_categories), _counts(b, num_categories)
  na, nb = ca.sum(), cb.sum()
  tv = 0.5 * float(np.abs(ca / na - cb / nb).sum())
  seen = (ca + cb) > 0
  ca, cb = ca[seen], cb[seen]
  share = (ca + cb) / (na + nb)
  # pool on the smaller sample's expected counts so both rows satisfy MIN_EXPECTED
  smaller = min(na, nb)
  pooled, ca, cb = _pool_small(smaller * share, ca, cb)
  share = pooled / smaller
  ea, eb = na * share, nb * share
  stat = float(np.sum((ca - ea) ** 2 / ea) + np.sum((cb - eb) ** 2 / eb))
  dof = share.size - 1
  pvalue = float(sps.chi2.sf(stat, dof)) if dof > 0 else 1.0
  return StatResult(stat, dof, pvalue, tv, int(na + nb), 0)


def assert_same_distribution(samples: np.ndarray, probs: np.ndarray, alpha: float = 1e-3, *,
                             what: str = "samples") -> StatResult:
  """Fail (with probability `alpha` when it holds) unless `samples` ~ `probs`."""
  res = goodness_of_fit(samples, probs)
  if res.pvalue < alpha:
    raise AssertionError(f"{what}: not distributed as expected at alpha={alpha}: {res.describe()}")
  return res


def assert_two_sample_same(a: np.ndarray, b: np.ndarray, num_categories: int,
                           alpha: float = 1e-3, *, what: str = "samples") -> StatResult:
  """Fail (with probability `alpha` when they are equal) unless `a` and `b` share a distribution."""
  res = two_sample(a, b, num_categories)
  if res.pvalue < alpha:
    raise AssertionError(f"{what}: the two samples differ at alpha={alpha}: {res.describe()}")
  return res


def softmax(x: np.ndarray) -> np.ndarray:
  """Softmax over the last axis (numpy)."""
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def sample_rows(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
  """One draw per row of probs [B, V] (inverse CDF, numpy)."""
  cdf = np.cumsum(probs, axis=-1)
  cdf /= cdf[:, -1:]
  return (rng.random(probs.shape[0])[:, None] > cdf).sum(-1).astype(np.int32)
