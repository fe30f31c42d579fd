"""The simulator's drafters: one registered cost model per way of drafting, the only place that
knows what a drafter costs per step, what it adds to memory, where its acceptance comes from.

Configs hold a drafter's name (as specjax's `DraftConfig.kind` does) and look it up once when they
are validated (`get_drafter_cost`); everything else calls methods on the object and never compares
names. Adding a drafter: subclass `DrafterCost` and `_register` an instance here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from specjax.sim import cost
from specjax.sim.catalog import HardwareSpec, ModelSpec
from specjax.sim.cost import Efficiency, Net

if TYPE_CHECKING:
  from specjax.sim.workload import Workload

TOKEN_ID_BYTES = 4


@dataclasses.dataclass(frozen=True)
class DrafterCost:
  """What the simulator asks of a drafter. The defaults are those of a drafter that costs
  nothing; subclasses override what theirs costs."""

  name: ClassVar[str] = ""
  # specjax draft kinds (`--rl.draft.kind`, either spelling) this cost model stands for
  kinds: ClassVar[tuple[str, ...]] = ()
  speculative: ClassVar[bool] = True  # False only for plain AR rollouts
  needs_draft_model: ClassVar[bool] = False  # drafts with a catalog model (Scenario.draft_model)
  advise_adaptive: ClassVar[bool] = True  # `advise` also tries adaptive K with it
  # said in advise's assumptions when no acceptance length is given for this drafter
  acceptance_note: ClassVar[str | None] = None

  def workload_acceptance(self, w: Workload) -> float:
    """Acceptance length at the workload's reference K (`acceptance_at`) when none is given."""
    return w.acceptance_length

  def weight_bytes(self, model: ModelSpec, draft_model: ModelSpec | None) -> float:
    """HBM the drafter's weights take beside the target's in a generation replica."""
    return 0.0

  def vllm_draft_time(self, model: ModelSpec, hw: HardwareSpec, eff: Efficiency, mp: int,
                      rows: np.ndarray, kv_tokens: np.ndarray, draft_len: int,
                      acceptance_length: float, draft_model: ModelSpec | None) -> np.ndarray:
    """Drafting seconds of one step of the vLLM-like engine (`cost.spec_step_time`), K >= 1."""
    return np.zeros_like(rows)

  def specjax_draft_time(self, ec, rows: int, draft_len: int, window: int) -> float:
    # ec: the `engine_cost.EngineCost` asking (not imported: it imports this module)
    """Drafting seconds of one iteration of specjax's engine (`EngineCost.step`), K >= 1."""
    return 0.0

  def prefill_time(self, ec, rows: int, prompt_len: int, cache_size: int) -> float:
    """Drafter work of specjax's prefill beside the target's forward over the prompts."""
    return 0.0

  def online_train_flops(self, model: ModelSpec, tokens: float, ttt_steps: int) -> float:
    """FLOPs the drafter's online adaptation adds to a train step over `tokens` tokens
    (Scenario.online_draft); none where the simulator models no online training."""
    return 0.0


@dataclasses.dataclass(frozen=True)
class NoDraftCost(DrafterCost):
  """Plain AR rollouts."""

  name: ClassVar[str] = "none"
  kinds: ClassVar[tuple[str, ...]] = ("none",)
  speculative: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class _NetDrafter(DrafterCost):
  """A drafter that runs a network: K sequential forwards, the first also catching up on the
  tokens the last verify committed."""

  def net(self, model: ModelSpec, draft_model: ModelSpec | None,
          draft_vocab: int = cost.DRAFT_VOCAB) -> Net:
    raise NotImplementedError

  def weight_bytes(self, model, draft_model):
    net = self.net(model, draft_model)
    return net.dense_params * net.bytes_per_param

  def vllm_draft_time(self, model, hw, eff, mp, rows, kv_tokens, draft_len, acceptance_length,
                      draft_model):
    net = self.net(model, draft_model)
    first = cost.forward_time(net, hw, eff, mp, rows * acceptance_length, kv_tokens,
                              acceptance_length, eff.draft_overhead_s)
    rest = cost.forward_time(net, hw, eff, mp, rows, kv_tokens, 1.0, eff.draft_overhead_s)
    return first + (draft_len - 1) * rest

  def specjax_draft_time(self, ec, rows, draft_len, window):
    # the first forward feeds the last two committed tokens (static shapes: always two)
    net, e = self.net(ec.model, ec.draft_model, ec.draft_vocab), ec.eff
    first = cost.forward_time(net, ec.hardware, e, ec.mp, rows * 2, rows * window, 2,
                              e.draft_overhead_s, logit_tokens=rows)
    rest = cost.forward_time(net, ec.hardware, e, ec.mp, rows, rows * window, 1,
                             e.draft_overhead_s)
    return float(first + (draft_len - 1) * rest)


@dataclasses.dataclass(frozen=True)
class Eagle3Cost(_NetDrafter):
  """An EAGLE-3 head on the target's features, with a reduced draft vocabulary."""

  name: ClassVar[str] = "eagle3"
  kinds: ClassVar[tuple[str, ...]] = ("eagle3",)

  def net(self, model, draft_model, draft_vocab=cost.DRAFT_VOCAB):
    return cost.eagle3_net(model, draft_vocab)

  def online_train_flops(self, model, tokens, ttt_steps):
    # the head's forward + backward (3x forward FLOPs) for each unrolled training-time-test step
    return ttt_steps * 3.0 * self.net(model, None).flops_per_token() * tokens


@dataclasses.dataclass(frozen=True)
class MtpCost(_NetDrafter):
  """The target's native multi-token-prediction module."""

  name: ClassVar[str] = "mtp"
  kinds: ClassVar[tuple[str, ...]] = ("mtp",)

  def net(self, model, draft_model, draft_vocab=cost.DRAFT_VOCAB):
    return cost.mtp_net(model)


@dataclasses.dataclass(frozen=True)
class DraftModelCost(_NetDrafter):
  """A smaller model of the same family, with its own KV cache and prompt encoding."""

  name: ClassVar[str] = "draft-model"
  kinds: ClassVar[tuple[str, ...]] = ("draft-model", "draft_model")
  needs_draft_model: ClassVar[bool] = True
  acceptance_note: ClassVar[str | None] = "acceptance defaults to EAGLE-3's unless given"

  def net(self, model, draft_model, draft_vocab=cost.DRAFT_VOCAB):
    if draft_model is None:
      raise ValueError(f"drafter {self.name!r}: needs a draft model")
    return cost.target_net(draft_model)

  def weight_bytes(self, model, draft_model):
    return draft_model.weight_bytes

  def prefill_time(self, ec, rows, prompt_len, cache_size):
    return float(cost.forward_time(self.net(ec.model, ec.draft_model), ec.hardware, ec.eff,
                                   ec.mp, rows * prompt_len, rows * cache_size, prompt_len,
                                   ec.eff.draft_overhead_s, logit_tokens=0))


@dataclasses.dataclass(frozen=True)
class NgramCost(DrafterCost):
  """Proposals looked up in the rows' own token ids (specjax's ngram and group-ngram)."""

  name: ClassVar[str] = "ngram"
  kinds: ClassVar[tuple[str, ...]] = ("ngram", "group-ngram", "group_ngram")
  advise_adaptive: ClassVar[bool] = False

  def workload_acceptance(self, w):
    return w.ngram_acceptance_length

  def vllm_draft_time(self, model, hw, eff, mp, rows, kv_tokens, draft_len, acceptance_length,
                      draft_model):
    # Proposals are computed on the host from token ids: the step blocks on a device->host copy
    # of the accepted tokens (no overlap of scheduling with the GPU), then every live row's
    # context is scanned for the longest suffix match.
    return np.where(rows > 0, eff.step_overhead_s + eff.host_ngram_s_per_token * kv_tokens, 0.0)

  def specjax_draft_time(self, ec, rows, draft_len, window):
    # on the device, inside the program: one scan of every row's token ids per draft token
    ids = rows * window * TOKEN_ID_BYTES * draft_len
    return float(ids / (ec.mp * ec.hardware.hbm_bw * ec.eff.bw) + ec.eff.draft_overhead_s)


DRAFTER_COSTS: dict[str, DrafterCost] = {}
DRAFT_KINDS: dict[str, DrafterCost] = {}  # every specjax draft-kind spelling -> its cost model


def _register(d: DrafterCost) -> DrafterCost:
  DRAFTER_COSTS[d.name] = d
  DRAFT_KINDS.update({k: d for k in d.kinds})
  return d


NO_DRAFT = _register(NoDraftCost())
EAGLE3 = _register(Eagle3Cost())
DRAFT_MODEL = _register(DraftModelCost())
MTP = _register(MtpCost())
NGRAM = _register(NgramCost())


def get_drafter_cost(name: str, field: str = "drafter") -> DrafterCost:
  """The cost model registered as `name`; the error names the config `field` that gave it."""
  if name not in DRAFTER_COSTS:
    raise ValueError(f"{field}: must be one of {tuple(DRAFTER_COSTS)}, got {name!r}")
  return DRAFTER_COSTS[name]


def drafter_for_kind(kind: str, field: str = "draft_kind") -> DrafterCost:
  """The cost model of a specjax draft kind (`group-ngram` is simulated as `ngram`)."""
  if kind not in DRAFT_KINDS:
    raise ValueError(f"{field}: must be one of {sorted(DRAFT_KINDS)}, got {kind!r}")
  return DRAFT_KINDS[kind]
