"""Adaptive draft length: running per-position acceptance estimates and the choice of K per
segment from them and the measured step costs; and, for a queue, how many free slots make a
segment return to refill them (`RefillPolicy`). Plain Python and numpy.

Why: a verify of K+1 tokens is nearly free while the live batch is small (weight reads dominate)
and costs K+1 steps once arithmetic dominates, so the best K moves with the live batch and with how
well the drafter is doing. Every choice depends only on timings and tokens already emitted, so
each step is verified exactly as in the static loop.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from specjax.sampling.buckets import NO_LIMIT
from specjax.sampling.engine_config import AdaptiveConfig


class AcceptanceEstimate:
  """Running per-position conditional acceptance: a_i = P(draft i accepted | drafts < i were),
  from drafts that offered position i, shrunk toward a prior (position 0) or toward a_{i-1}."""

  def __init__(self, max_len: int, prior: float, weight: float):
    self.offered = np.zeros(max_len)
    self.hits = np.zeros(max_len)
    self.prior, self.weight = prior, weight

  def decay(self, factor: float) -> None:
    """Weigh earlier counts by `factor` (recent steps matter more; old evidence fades toward the
    prior, so a drafter that failed once is tried again later)."""
    self.offered *= factor
    self.hits *= factor

  @property
  def seen(self) -> bool:
    return bool(self.offered[0] > 0)

  def add(self, draft_len: int, drafts: float, accepted_per_position: np.ndarray) -> None:
    """One segment's counts: `drafts` drafts of length `draft_len`; accepted_per_position[i] of
    them had their first i + 1 tokens accepted."""
    for i in range(draft_len):
      self.offered[i] += drafts if i == 0 else accepted_per_position[i - 1]
      self.hits[i] += accepted_per_position[i]

  def conditional(self) -> np.ndarray:
    out, prev = np.zeros(len(self.offered)), self.prior
    for i in range(len(out)):
      prev = out[i] = (self.hits[i] + prev * self.weight) / (self.offered[i] + self.weight)
    return out

  def expected_tokens(self, draft_len: int) -> float:
    """E[tokens a row commits in one step] = 1 + sum_{i<K} prod_{j<=i} a_j."""
    return 1.0 + float(np.sum(np.cumprod(self.conditional()[:draft_len])))


class AcceptanceEstimates:
  """One running `AcceptanceEstimate` per (drafter, sampling config, target), kept across the
  rollouts of whoever owns this object (see `calibration.EngineTuning`)."""

  def __init__(self):
    self._by_key: dict[tuple, AcceptanceEstimate] = {}
    # stored estimates not asked for yet, by the stable name of their key (`load_json`)
    self._stored: dict[str, dict] = {}
    self._name: Callable[[tuple], str] | None = None

  def get(self, key: tuple, max_len: int, cfg: AdaptiveConfig) -> AcceptanceEstimate:
    if key not in self._by_key:
      est = AcceptanceEstimate(max_len, cfg.prior_acceptance, cfg.prior_weight)
      stored = self._stored.pop(self._name(key), None) if self._stored else None
      if stored is not None and len(stored["offered"]) == max_len:
        est.offered = np.asarray(stored["offered"], np.float64)
        est.hits = np.asarray(stored["hits"], np.float64)
      self._by_key[key] = est
    return self._by_key[key]

  def to_json(self, name: Callable[[tuple], str]) -> dict:
    """{stable name of the key: counts} (exact floats), including stored ones not asked for."""
    out = dict(self._stored)
    for key, est in self._by_key.items():
      out[name(key)] = {"offered": est.offered.tolist(), "hits": est.hits.tolist()}
    return out

  def load_json(self, data: dict, name: Callable[[tuple], str]) -> None:
    """Adopt stored counts (`to_json`): each is taken up when `get` first asks for its key."""
    self._by_key.clear()
    self._stored = {k: dict(v) for k, v in data.items()}
    self._name = name

  def __len__(self) -> int:
    return len(self._by_key)


def best_draft_len(expected_tokens: dict[int, float], step_costs: dict[int, float],
                   live: int, min_gain: float = 0.0) -> tuple[int, float]:
  """(K, tokens/s) maximising live * E[tokens per step | K] / seconds per step at K; a K > 0
  must beat K = 0 (when offered) by the fraction `min_gain`, so that timing noise never keeps
  drafts that are not accepted. Every cost must be a positive, finite number of seconds (the
  cost table checks them where they are measured, stored and read; one that is not here is a bug
  of the caller's)."""
  for k in expected_tokens:
    cost = step_costs[k]
    if not (isinstance(cost, (int, float)) and math.isfinite(cost) and cost > 0):
      raise ValueError(f"best_draft_len: the step cost at K = {k} is {cost!r}; costs must be "
                       f"positive and finite")
  rates = {k: live * expected_tokens[k] / step_costs[k] for k in expected_tokens}
  bar = {k: r / (1.0 + min_gain) if k > 0 and 0 in rates else r for k, r in rates.items()}
  k = max(bar, key=bar.get)
  return k, rates[k]


class DraftLenPolicy:
  """The choice of K over one rollout: from `k_choices` (one value: fixed K, no choice), with the
  acceptance `estimate` carried across rollouts."""

  def __init__(self, k_choices: tuple[int, ...], estimate: AcceptanceEstimate,
               cfg: AdaptiveConfig, retire: bool = False):
    """`retire`: the drafter keeps state that AR steps must feed (`Drafter.stateful`), so it is
    set aside once the counts rule it out rather than rechecked (`choose`)."""
    self.k_choices, self.estimate, self.cfg = k_choices, estimate, cfg
    self.adaptive = len(k_choices) > 1
    self.can_retire = retire
    self.retired = False  # see `choose`
    self.rechecking = False  # an AR segment ran since the last drafting one (`ran`)

  @property
  def thin(self) -> bool:
    """Fewer drafts than `probe_drafts` behind the estimate (a first rollout, or counts that
    faded since)."""
    return bool(self.estimate.offered[0] < max(self.cfg.probe_drafts, 1e-9))

  def choose(self, cost: Callable[[int], float], live: int) -> tuple[int, float]:
    """(K, expected tokens/s) maximising live * E[tokens | K] / cost(K). Every K is costed first
    (the engine times a bucket's K = 0 and largest K on its first visit; a K in between costs an
    estimate until a segment runs it).

    When the acceptance measured so far rules out every K > 0, the policy runs AR segments of
    `recheck_iters` steps, over which the counts fade toward the prior (`ran`), until a K > 0
    promises a gain again and a short segment measures the drafter anew. A stateful drafter
    (`retire`: EAGLE-3, MTP, a draft model) would have to observe every AR step meanwhile, so
    once counts that are not thin rule it out it is *retired* for the rest of the rollout: no
    more observing, no rechecks. The next rollout starts with the drafter again."""
    if not self.adaptive:
      return self.k_choices[0], float("nan")
    if self.retired:
      return 0, float("nan")
    costs = {k: cost(k) for k in self.k_choices}
    if not self.estimate.seen:  # acceptance is a guess: draft once so the estimate can learn
      choices = list(self.k_choices[1:])
    else:  # a K whose expected tokens cannot beat AR by min_gain is not even measured
      bar = 1.0 + self.cfg.min_gain
      choices = [k for k in self.k_choices if k == 0 or self.estimate.expected_tokens(k) > bar]
      self.retired = choices == [0] and self.can_retire and not self.thin
    if len(choices) == 1:
      return choices[0], float("nan")
    return best_draft_len({k: self.estimate.expected_tokens(k) for k in choices},
                          {k: costs[k] for k in choices}, live, self.cfg.min_gain)

  def budget(self, k: int, j: int) -> int:
    """Steps a segment at K may run before K is chosen again; `j` counts the segments the
    bucket already ran at this K."""
    if not self.adaptive:
      return NO_LIMIT
    if k == 0:
      # plain AR collects no acceptance evidence: without rechecks (or once the drafter is
      # retired) a re-decision would choose K = 0 again, so it runs until the bucket or window
      # ends; with them it re-decides after recheck_iters steps, the counts faded meanwhile
      return NO_LIMIT if self.retired or not self.cfg.recheck_iters else self.cfg.recheck_iters
    if self.thin or self.rechecking:
      # thin evidence, or a drafter rechecked after an AR stretch: draft briefly, then decide
      # again, so a drafter that fails costs a few steps, not a segment
      return self.cfg.probe_iters
    return min(self.cfg.first_segment_iters << j, self.cfg.max_segment_iters)

  def ran(self, k: int, iters: int) -> None:
    """A segment ran `iters` steps at K. AR steps fade the counts (recheck_decay per
    recheck_iters steps) and make the next drafting segment a short one; a drafting segment
    ends the recheck."""
    if not self.adaptive or self.retired or not self.cfg.recheck_iters:
      return
    if k == 0:
      self.estimate.decay(self.cfg.recheck_decay ** (iters / self.cfg.recheck_iters))
      self.rechecking = True
    else:
      self.rechecking = False


class DraftShapePolicy:
  """The choice of (K, tree width) over one rollout: a `DraftLenPolicy` per width, each with its
  own acceptance estimate (width 1: the drafter's chain; its `tree_width`: the draft tree, whose
  alternatives raise acceptance at the cost of a wider verify). Each width's policy picks its K;
  the tree then runs where it promises more tokens/s than the chain by `min_gain` (its costs and
  acceptance measured like K's), and once before that, so that its acceptance is measured at
  all. One width: that width's policy alone."""

  def __init__(self, policies: dict[int, DraftLenPolicy], cfg: AdaptiveConfig):
    self.policies, self.cfg = policies, cfg
    self.widths = tuple(policies)
    first = policies[self.widths[0]]
    self.k_choices, self.adaptive = first.k_choices, first.adaptive

  def estimate(self, width: int) -> AcceptanceEstimate:
    return self.policies[width].estimate

  @property
  def retired(self) -> bool:
    """Every width's policy set the drafter aside (`DraftLenPolicy.choose`)."""
    return all(p.retired for p in self.policies.values())

  def budget(self, k: int, width: int, j: int) -> int:
    return self.policies[width].budget(k, j)

  def ran(self, k: int, width: int, iters: int) -> None:
    """A segment ran (`DraftLenPolicy.ran`): an AR one concerns every width's estimate."""
    for w, policy in self.policies.items():
      if k == 0 or w == width:
        policy.ran(k, iters)

  def choose(self, cost: Callable[[int, int], float], live: int) -> tuple[int, int, float]:
    """(K, width, expected tokens/s); `cost(K, width)` seconds per step."""
    if len(self.widths) == 1:
      w = self.widths[0]
      return _with_width(self.policies[w].choose(lambda k: cost(k, w), live), w)
    picks = {}
    for w, policy in self.policies.items():
      if policy.retired:
        continue
      k, _ = policy.choose(lambda k, w=w: cost(k, w), live)
      rate = live * (policy.estimate.expected_tokens(k) if k else 1.0) / cost(k, w)
      picks[w] = (k, rate)
    if not picks:
      return 0, self.widths[0], float("nan")
    chain, tree = self.widths[0], self.widths[-1]
    if tree in picks and picks[tree][0] > 0 and not self.estimate(tree).seen and \
        (chain not in picks or self.estimate(chain).seen):
      return picks[tree][0], tree, float("nan")  # measure the tree's acceptance once
    bar = {w: r / (1.0 + self.cfg.min_gain) if w != chain and k > 0 else r
           for w, (k, r) in picks.items()}
    w = max(bar, key=bar.get)
    k = picks[w][0]
    return k, (w if k > 0 else chain), picks[w][1]


def _with_width(choice: tuple[int, float], width: int) -> tuple[int, int, float]:
  return choice[0], width, choice[1]


def best_refill(slots: int, unit: int, step_s: float, finish_rate: float, refill_s: float,
                row_s: float) -> int:
  """The free slots that should make a segment return to refill them. `slots` are stepped at `step_s` seconds per step whether busy or not; rows finish at
  `finish_rate` per step; a refill of f rows costs `refill_s + f * row_s` seconds (the host
  round trip and admission, and the rows' prefill).

  Between refills the free slots grow from 0 to f in f / rate steps, so on average f / 2 slots
  idle, and each step carries a share rate / f of one refill. Tokens per second then go as
  (slots - f / 2) / (step_s + rate * (row_s + refill_s / f)): a refill's fixed cost argues for a
  large f, the idle slots for a small one. The best f among the multiples of `unit` (the
  data-parallel size, which admissions fill evenly) up to `slots`; with no finishes seen yet
  (rate 0) the smallest."""
  rate = lambda f: (slots - f / 2) / (step_s + finish_rate * (row_s + refill_s / f))
  return max(range(unit, max(slots, unit) + 1, unit), key=rate)


class RefillPolicy:
  """How many free slots make a queue's segment return to refill them, over one rollout: `first`
  until the costs are known and rows have finished; then `best_refill` at the measured costs (a
  step at the full bucket and the chosen K, a refill's fixed seconds and its prefill per row)
  and the rate at which rows finish, a running count over the full bucket's segments (earlier
  segments' weight `decay` per segment: the rate drifts as long rows accumulate). The counts come
  from tokens already emitted and the costs from the stored calibration, so one seed gives one
  trajectory, as with K."""

  def __init__(self, slots: int, unit: int, first: int, decay: float = 0.7):
    self.slots, self.unit, self.first, self.decay = slots, unit, first, decay
    self.finished, self.steps = 0.0, 0.0
    self.costs: tuple[float, float] | None = None  # (fixed s per refill, prefill s per row)

  def observe(self, finished: int, steps: int) -> None:
    """A full-bucket segment with rows waiting: `finished` rows ended in its `steps`."""
    self.finished = self.decay * self.finished + finished
    self.steps = self.decay * self.steps + steps

  def threshold(self, step_s: float, segment_s: float = 0.0) -> int:
    """Free slots that make the next segment return; `segment_s`: a segment's fixed cost at the
    bucket and K (its dispatch and host round trip), which every refill adds to the measured
    refill cost, since it ends a segment that would otherwise have run on."""
    if self.costs is None or self.finished <= 0:
      return self.first
    refill_s, row_s = self.costs
    return best_refill(self.slots, self.unit, step_s, self.finished / self.steps,
                       refill_s + segment_s, row_s)
