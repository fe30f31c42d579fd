"""Costs of specjax's engine iterations from the roofline of `cost.py`: one speculative step at
(bucket, K, window) = drafter + a target forward of K+1 tokens per row over a static window +
verify; the prefill; both for any machine whose `Efficiency` was fitted (CPU or GPU).
"""

from __future__ import annotations

import dataclasses
import functools

from specjax.config_tree import refuse
from specjax.sim import cost
from specjax.sim.catalog import HardwareSpec, ModelSpec
from specjax.sim.cost import Efficiency
from specjax.sim.drafter_costs import NO_DRAFT, DrafterCost, get_drafter_cost


@dataclasses.dataclass(frozen=True)
class EngineCost:
  """Per-iteration and prefill seconds of the engine on one replica of `mp` devices."""

  model: ModelSpec
  hardware: HardwareSpec
  eff: Efficiency
  drafter: str = NO_DRAFT.name
  draft_model: ModelSpec | None = None
  mp: int = 1
  draft_vocab: int = cost.DRAFT_VOCAB  # EAGLE-3 head's reduced vocabulary
  drafter_cost: DrafterCost = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    d = get_drafter_cost(self.drafter, "EngineCost.drafter")
    if d.needs_draft_model and self.draft_model is None:
      refuse(f"EngineCost.draft_model: required for drafter={self.drafter!r}")
    object.__setattr__(self, "drafter_cost", d)

  def target_forward(self, rows: int, tokens: int, window: int,
                     bare: bool = False) -> float:
    """A target forward of `tokens` tokens per row over a `window`-position static window;
    with the step's fixed bookkeeping (sampling, commit, loop) unless `bare`."""
    return float(cost.forward_time(cost.target_net(self.model), self.hardware, self.eff,
                                   self.mp, rows * tokens, rows * window, tokens,
                                   0.0 if bare else self.eff.step_overhead_s,
                                   logit_tokens=0 if bare else None))

  def draft_time(self, rows: int, draft_len: int, window: int) -> float:
    """K sequential draft forwards (or the drafter's equivalent work)."""
    if draft_len == 0:
      return 0.0
    return self.drafter_cost.specjax_draft_time(self, rows, draft_len, window)

  @functools.lru_cache(maxsize=4096)
  def step(self, bucket: int, draft_len: int, window: int) -> float:
    """One engine iteration: drafter + target forward of K+1 tokens + verify (the verify's
    softmax / sampling work is the logits term of the forward)."""
    return self.target_forward(bucket, draft_len + 1, window) + self.draft_time(
        bucket, draft_len, window)

  def paged_step(self, bucket: int, draft_len: int, kv_tokens: float) -> float:
    """One iteration of the paged engine: `bucket` slots (static shapes: every slot computes its
    K+1 tokens) whose live rows attend to the `kv_tokens` positions they hold (empty slots and
    finished rows read no pages)."""
    t = float(cost.forward_time(cost.target_net(self.model), self.hardware, self.eff, self.mp,
                                bucket * (draft_len + 1), kv_tokens, draft_len + 1,
                                self.eff.step_overhead_s))
    return t + self.draft_time(bucket, draft_len, kv_tokens / bucket)

  def paged_prefill(self, rows: int, tokens: float, kv_tokens: float, queries_per_row: float,
                    draft_len: int = 0) -> float:
    """One prefill forward of the paged engine: `tokens` new tokens (the admitted groups'
    prompts once, recomputed rows' tokens) whose sequences span `kv_tokens` positions, causal
    attention of `queries_per_row` x kv_tokens (query, position) pairs, logits for one position
    per admitted row; a draft model encodes the same tokens."""
    net = cost.target_net(self.model)
    t = float(cost.forward_time(net, self.hardware, self.eff, self.mp, tokens, kv_tokens,
                                queries_per_row, self.eff.step_overhead_s, logit_tokens=rows))
    if draft_len:
      t += self.drafter_cost.prefill_time(self, rows, tokens / rows, kv_tokens / rows)
    return t

  def prefill(self, rows: int, prompt_len: int, cache_size: int, draft_len: int = 0) -> float:
    """One forward over the padded prompts against the static cache (logits at one position
    per row); a draft model also encodes the prompts."""
    net = cost.target_net(self.model)
    t = cost.forward_time(net, self.hardware, self.eff, self.mp, rows * prompt_len,
                          rows * cache_size, prompt_len, self.eff.step_overhead_s,
                          logit_tokens=rows)
    if draft_len:
      t = t + self.drafter_cost.prefill_time(self, rows, prompt_len, cache_size)
    return float(t)
