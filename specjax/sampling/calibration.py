"""What the rollout engine learns by running, and who keeps it: the measured cost of each compiled
(program, bucket, K) (`cost_table.CostTable`) and the running acceptance estimates, bundled as
`EngineTuning`. Plain Python; the engine hands it the timed segment runs.

Whoever runs rollouts owns one `EngineTuning` and passes it to every `generate` /
`speculative_generate` call that should reuse it (an RL run keeps one for all its rollouts); a
call without one calibrates afresh and forgets. Two engines never share costs by accident.

Reproducibility: the K the adaptive engine picks depends on the step costs, and the random stream
on the K picked. A run's costs are fixed for the run once read or measured: a cost is measured
once per program, bucket and K and then kept, in the table, in the run's `RunCosts` (a snapshot
of the machine's `CostCache` file taken when the run starts, plus what it measured; an RL run
keeps it in its run directory and reads it back on resume, whatever the machine's file holds by
then), in the machine's `CostCache` (keyed by a stable description of the program and the
device, so a later run reads the timings and skips measuring them) and in `EngineTuning.to_json`
(an RL run stores it in every checkpoint). Every cost is checked where it is measured, stored and
read (`cost_cache.cost_problem`, `implausible_keys`). In-run refinement of the costs by the
segments' own timings (`EngineConfig.calibration.cost_memory` > 0) makes the K choices follow the
machine's load, hence not reproducible; it is off by default.
"""

from __future__ import annotations

import dataclasses
import functools

from specjax.sampling.adaptive import AcceptanceEstimates
from specjax.sampling.cost_cache import CostCache
from specjax.sampling.cost_table import CostTable, stable_digest

TUNING_FORMAT = 1


@dataclasses.dataclass(eq=False)
class EngineTuning:
  """The engine's measured step costs and acceptance estimates, owned by whoever runs rollouts
  and passed as `tuning=` to every call that should reuse them."""

  costs: CostTable = dataclasses.field(default_factory=CostTable)
  estimates: AcceptanceEstimates = dataclasses.field(default_factory=AcceptanceEstimates)

  @classmethod
  def with_cache(cls, path: str) -> EngineTuning:
    """A tuning whose costs come from (and go to) the machine's cost cache at `path` ("off" or
    "": no cache)."""
    return cls(costs=CostTable(None if path in ("", "off") else CostCache(path)))

  def calibration_table(self) -> list[dict]:
    return self.costs.rows()

  def to_json(self) -> dict:
    """Costs and acceptance estimates as plain JSON (exact floats): `load_json` in another
    process continues with the very same K choices."""
    return {"format": TUNING_FORMAT, "costs": self.costs.to_json(),
            "estimates": self.estimates.to_json(estimate_key_digest)}

  def load_json(self, data: dict | None, source: str = "stored engine tuning") -> None:
    """Adopt a stored tuning (`to_json`) from `source` (named in warnings); None or {}: nothing
    to adopt."""
    if not data:
      return
    if data.get("format") != TUNING_FORMAT:
      raise ValueError(f"engine tuning of format {data.get('format')!r}; this version reads "
                       f"{TUNING_FORMAT}")
    self.costs.load_json(data.get("costs", []), source)
    self.estimates.load_json(data.get("estimates", {}), estimate_key_digest)


@functools.lru_cache(maxsize=64)
def estimate_key_digest(key: tuple) -> str:
  """Stable name of an acceptance estimate's key ((drafter, sampling config, graphdef))."""
  return stable_digest(*key)
