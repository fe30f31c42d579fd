"""Costs of specjax's engine iterations from the roofline of `cost.py`: one speculative step at
(bucket, K, window) = drafter + a target forward of K+1 tokens per row over a static window +
verify; the prefill; both for any machine whose `Efficiency` was fitted (CPU or GPU).
"""

from __future__ import annotations

import dataclasses
import functools

from specjax.sim import cost
from specjax.sim.catalog import HardwareSpec, ModelSpec
from specjax.sim.cost import Efficiency

ENGINE_DRAFTERS = ("none", "draft-model", "eagle3", "mtp", "ngram")
TOKEN_ID_BYTES = 4


@dataclasses.dataclass(frozen=True)
class EngineCost:
  """Per-iteration and prefill seconds of the engine on one replica of `mp` devices."""

  model: ModelSpec
  hardware: HardwareSpec
  eff: Efficiency
  drafter: str = "none"
  draft_model: ModelSpec | None = None
  mp: int = 1
  draft_vocab: int = cost.DRAFT_VOCAB  # EAGLE-3 head's reduced vocabulary

  def __post_init__(self):
    if self.drafter not in ENGINE_DRAFTERS:
      raise ValueError(f"EngineCost.drafter: must be one of {ENGINE_DRAFTERS}, got "
                       f"{self.drafter!r}")
    if self.drafter == "draft-model" and self.draft_model is None:
      raise ValueError("EngineCost.draft_model: required for drafter='draft-model'")

  def _draft_net(self):
    if self.drafter == "draft-model":
      return cost.target_net(self.draft_model)
    if self.drafter == "eagle3":
      return cost.eagle3_net(self.model, self.draft_vocab)
    return cost.mtp_net(self.model)

  def target_forward(self, rows: int, tokens: int, window: int,
                     bare: bool = False) -> float:
    """A target forward of `tokens` tokens per row over a `window`-position static window;
    with the step's fixed bookkeeping (sampling, commit, loop) unless `bare`."""
    return float(cost.forward_time(cost.target_net(self.model), self.hardware, self.eff,
                                   self.mp, rows * tokens, rows * window, tokens,
                                   0.0 if bare else self.eff.step_overhead_s,
                                   logit_tokens=0 if bare else None))

  def draft_time(self, rows: int, draft_len: int, window: int) -> float:
    """K sequential draft forwards; the first also feeds the last two committed tokens."""
    if draft_len == 0 or self.drafter == "none":
      return 0.0
    e = self.eff
    if self.drafter == "ngram":
      # on the device, inside the program: one scan of every row's token ids per draft token
      ids = rows * window * TOKEN_ID_BYTES * draft_len
      return float(ids / (self.mp * self.hardware.hbm_bw * e.bw) + e.draft_overhead_s)
    net = self._draft_net()
    first = cost.forward_time(net, self.hardware, e, self.mp, rows * 2, rows * window, 2,
                              e.draft_overhead_s, logit_tokens=rows)
    rest = cost.forward_time(net, self.hardware, e, self.mp, rows, rows * window, 1,
                             e.draft_overhead_s)
    return float(first + (draft_len - 1) * rest)

  @functools.lru_cache(maxsize=4096)
  def step(self, bucket: int, draft_len: int, window: int) -> float:
    """One engine iteration: drafter + target forward of K+1 tokens + verify (the verify's
    softmax / sampling work is the logits term of the forward)."""
    return self.target_forward(bucket, draft_len + 1, window) + self.draft_time(
        bucket, draft_len, window)

  def prefill(self, rows: int, prompt_len: int, cache_size: int, draft_len: int = 0) -> float:
    """One forward over the padded prompts against the static cache (logits at one position
    per row); a draft model also encodes the prompts."""
    net = cost.target_net(self.model)
    t = cost.forward_time(net, self.hardware, self.eff, self.mp, rows * prompt_len,
                          rows * cache_size, prompt_len, self.eff.step_overhead_s,
                          logit_tokens=rows)
    if draft_len and self.drafter == "draft-model":
      t = t + cost.forward_time(self._draft_net(), self.hardware, self.eff, self.mp,
                                rows * prompt_len, rows * cache_size, prompt_len,
                                self.eff.draft_overhead_s, logit_tokens=0)
    return float(t)
