"""What keeps an RL run safe from its own values and interruptions: the guard against non-finite
rewards, advantages, losses and gradients, and the step whose metrics are not yet written.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np

NONFINITE_KEY = "guard/nonfinite"  # the names of a bad step's non-finite values, in its record


class NonFiniteError(RuntimeError):
  """Too many consecutive steps with non-finite values (RLConfig.max_bad_steps)."""


def nonfinite_names(**values: Any) -> list[str]:
  """The names of the values (arrays or scalars) that hold NaN or infinite entries."""
  bad = []
  for name, v in values.items():
    a = np.asarray(jax.device_get(v))
    if np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
      bad.append(name)
  return bad


def state_donated(state: Any) -> bool:
  """True when the state's buffers were donated to an update that did not return (an interrupt
  inside the train step): there is nothing left to checkpoint."""
  return any(getattr(x, "is_deleted", None) is not None and x.is_deleted()
             for x in jax.tree.leaves(state))


class NonFiniteGuard:
  """Counts consecutive bad steps; logs each as a `nonfinite_step` event and raises
  `NonFiniteError` at the `max_bad_steps`-th in a row (at the first when it is 0)."""

  def __init__(self, max_bad_steps: int):
    self.max_bad_steps = max_bad_steps
    self.consecutive = 0

  def update(self, step: int, bad: list[str], logger) -> None:
    if not bad:
      self.consecutive = 0
      return
    self.consecutive += 1
    limit = max(self.max_bad_steps, 1)
    stop = self.consecutive >= limit
    skipped = self.max_bad_steps > 0  # 0: the run stops at once, nothing to skip to
    logger.log_event(step, "nonfinite_step", values=bad, consecutive=self.consecutive,
                     update="skipped" if skipped else "stopped")
    msg = (f"step {step}: non-finite {', '.join(bad)}; "
           f"{'the update was skipped (parameters unchanged)' if skipped else 'no skipping'} "
           f"({self.consecutive} bad step(s) in a row, RLConfig.max_bad_steps="
           f"{self.max_bad_steps})")
    if stop:
      raise NonFiniteError(f"{msg}: stopping the run. Check the reward function and the "
                           f"learning rate; the last checkpoint holds finite parameters")
    warnings.warn(msg)


@dataclasses.dataclass
class PendingStep:
  """A step whose update is adopted but whose metrics are not written yet (validation runs in
  between). An exit checkpoint of this step carries it; the resumed run writes it first, so an
  interruption during validation loses no step and logs none twice."""

  step: int
  data_position: int
  metrics: dict
  errors: list[str]

  def to_json(self) -> dict:
    from specjax.rl.metrics_log import _plain

    return {"step": self.step, "data_position": self.data_position,
            "metrics": _plain(self.metrics), "errors": list(self.errors)}

  @classmethod
  def from_json(cls, data: dict | None) -> "PendingStep | None":
    if not data:
      return None
    return cls(int(data["step"]), int(data["data_position"]), dict(data["metrics"]),
               list(data["errors"]))
