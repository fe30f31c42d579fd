"""Calibrated efficiency factors per hardware (the output of `calibrate.fit_efficiency`).

Regenerate with `python experiments/simulate.py --calibrate`; provenance in docs/SIMULATOR.md.
"""

from __future__ import annotations

from specjax.sim.cost import Efficiency

# Fitted on the paper's Qwen3-8B / 32 GB200 measurements (calibrate.paper_cases()).
CALIBRATED: dict[str, Efficiency] = {
    "gb200": Efficiency(bw=0.664, flops=0.5, step_overhead_s=1.77e-3, draft_overhead_s=7.01e-4,
                        mfu=0.259, comm=0.7, host_ngram_s_per_token=1.94e-7,
                        prepare_overhead_s=5.0, other_s=2.0),
}

# Hardware without measurements inherits the fractions fitted on this one.
REFERENCE = "gb200"


def efficiency_for(hardware: str) -> Efficiency:
  """Calibrated factors of `hardware`, else those of the reference hardware."""
  return CALIBRATED.get(hardware.lower(), CALIBRATED[REFERENCE])
