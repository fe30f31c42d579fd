"""Draft methods: each way of drafting (`ngram`, `draft-model`, `eagle3`, ...) is one registered,
hashable object next to its drafter, and the only place that knows how that drafter is built,
initialised, fed by the sampler and trained online. Callers look it up by name and never compare.

Adding a drafter: write a frozen dataclass with `name` and the methods of `DraftMethod` (subclass
`DraftMethodBase` for the defaults of a drafter that trains nothing) and `register_method` an
instance in the drafter's own module, which `specjax/drafters/__init__.py` imports: importing
any part of `specjax.drafters` registers every built-in method.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import jax

from specjax.config_tree import refuse
from specjax.sampling.drafter import Drafter


@dataclasses.dataclass(frozen=True)
class DraftInit:
  """The initial "policy" and "draft" parameter groups of a train state, the non-trained drafter
  inputs (`draft_aux`, e.g. EAGLE-3 vocabulary maps) and the draft object `build_drafter` takes."""

  policy: Any
  draft: Any = None  # None: the draft group is empty
  draft_aux: Any = ()
  draft_obj: Any = None


@dataclasses.dataclass(frozen=True)
class DraftLossInputs:
  """What the train step hands an online draft loss: the policy's own forward on the batch (its
  features enter under stop_gradient) and the parameter groups."""

  params: dict  # {"policy": ..., "draft": ...} (the draft group is what the loss trains)
  embed: jax.Array  # the policy's token embedding table [V, d]
  out: Any  # the policy forward's DecoderOutput (logits, hidden, aux_hidden)
  tokens: jax.Array  # int32[B, S]
  mask: jax.Array  # float32[B, S] completion tokens
  draft_aux: Any
  policy_graphdef: Any = None
  draft_graphdef: Any = None
  ttt_steps: int = 1  # EAGLE-3 training-time-test unroll


DraftLoss = Callable[[DraftLossInputs], "tuple[jax.Array, dict[str, jax.Array]]"]


@dataclasses.dataclass(frozen=True)
class OfflineDraft:
  """What a method's `offline_draft` hands the RL runs: the policy they start from (for "mtp",
  with its MTP module trained) and the draft object and vocabulary maps `setup_run` takes."""

  policy: Any
  draft: Any = None
  draft_maps: Any = None


class OfflineEnv(Protocol):
  """What the application lends a method to build its draft before RL: where the policy came
  from, its (cached) offline trainers on the policy's own rollouts of the RL prompts, and a log.
  The methods choose what to call; the application never looks at the kind."""

  policy_dir: str  # the Hugging Face directory the policy was loaded from
  draft_model_layers: int  # draft-model without DraftConfig.path: the policy's first N layers

  def log(self, message: str) -> None: ...

  def train_eagle3(self, policy) -> tuple[Any, Any]:
    """(head, maps): an EAGLE-3 head trained offline (TTT) on the policy's rollouts."""
    ...

  def train_mtp(self, policy) -> Any:
    """The policy with its MTP module trained offline (trunk frozen) on its own rollouts."""
    ...


@runtime_checkable
class DraftMethod(Protocol):
  """One way of drafting. `draft_cfg` is the RL `DraftConfig` (draft_len, ngram_min/max, ...)."""

  name: ClassVar[str]
  speculative: ClassVar[bool]  # False only for "none" (plain AR rollouts)

  def init(self, draft_cfg, *, policy_cfg, policy_params, draft, draft_maps,
           seed: int) -> DraftInit:
    """Split the policy params into the train state's groups; build the draft's initial params."""
    ...

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft,
                    group_size: int) -> tuple[Drafter | None, Any]:
    """(drafter, fixed drafter params); fixed params are None when they follow training."""
    ...

  def train_graphdef(self, drafter: Drafter | None) -> Any:
    """The graphdef of a separately trained draft module (EAGLE-3 head), else None."""
    ...

  def forward_params(self, params: dict) -> Any:
    """The state the policy forward merges from (policy group, + the MTP module for "mtp")."""
    ...

  def sampler_params(self, params: dict, policy: Any, draft_aux: Any, fixed: Any) -> Any:
    """The drafter's params for the sampler, from the train state's groups, the policy state the
    sampler runs (`policy`, possibly cast) and the fixed drafter params."""
    ...

  @property
  def online_loss(self) -> DraftLoss | None:
    """The draft loss the train step adds (lambda-weighted) when DraftConfig.online; None: the
    method cannot learn online."""
    ...

  def policy_overrides(self, draft_cfg, policy_dir: str) -> dict:
    """ModelConfig overrides the policy at `policy_dir` is loaded with (MTP module, aux layers)."""
    ...

  def offline_draft(self, draft_cfg, policy, env: OfflineEnv) -> OfflineDraft:
    """The draft the RL runs start from: loaded from DraftConfig.path, derived from the policy, or
    trained offline with `env`'s trainers."""
    ...

  def save_draft(self, path: str, *, params: dict, draft_aux: Any, draft: Any) -> str | None:
    """Write the draft a run trained (train-state groups `params`) for serving; None: nothing to
    write (a fixed draft, or one inside the policy)."""
    ...


@dataclasses.dataclass(frozen=True)
class DraftMethodBase:
  """Defaults of a drafter that trains nothing and whose params (if any) are fixed."""

  name: ClassVar[str] = ""
  speculative: ClassVar[bool] = True

  def init(self, draft_cfg, *, policy_cfg, policy_params, draft, draft_maps,
           seed: int) -> DraftInit:
    return DraftInit(policy=policy_params, draft_obj=draft)

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft,
                    group_size: int) -> tuple[Drafter | None, Any]:
    raise NotImplementedError

  def train_graphdef(self, drafter: Drafter | None) -> Any:
    return None

  def forward_params(self, params: dict) -> Any:
    return params["policy"]

  def sampler_params(self, params: dict, policy: Any, draft_aux: Any, fixed: Any) -> Any:
    return fixed

  @property
  def online_loss(self) -> DraftLoss | None:
    return None

  def policy_overrides(self, draft_cfg, policy_dir: str) -> dict:
    return {}

  def offline_draft(self, draft_cfg, policy, env: OfflineEnv) -> OfflineDraft:
    return OfflineDraft(policy=policy)

  def save_draft(self, path: str, *, params: dict, draft_aux: Any, draft: Any) -> str | None:
    return None


_METHODS: dict[str, DraftMethod] = {}


def register_method(method: DraftMethod) -> DraftMethod:
  """Add `method` under `method.name` (registering an equal object again is a no-op)."""
  if not method.name:
    raise ValueError(f"register_method: {type(method).__name__}.name is empty")
  old = _METHODS.get(method.name)
  if old is not None and old != method:
    raise ValueError(f"register_method: {method.name!r} is already {old!r}")
  _METHODS[method.name] = method
  return method


def get_method(name: str) -> DraftMethod:
  if name not in _METHODS:
    refuse(f"DraftConfig.kind: must be one of {method_names()}, got {name!r}")
  return _METHODS[name]


def method_names(*, online: bool = False) -> list[str]:
  """Registered names, sorted (`online`: only those with an online loss)."""
  return sorted(n for n, m in _METHODS.items() if not online or m.online_loss is not None)


@dataclasses.dataclass(frozen=True)
class NoDraft(DraftMethodBase):
  """Plain AR rollouts."""

  name: ClassVar[str] = "none"
  speculative: ClassVar[bool] = False

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft, group_size):
    return None, None


register_method(NoDraft())
