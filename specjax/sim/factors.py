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
    # Fitted on specjax's own engine runs on the project's 2-core CPU, process CPU time
    # (docs/sim_data/cpu_validation_cputime.json; docs/SIMULATOR.md, CPU calibration).
    "cpu": Efficiency(bw=0.3456, kv_bw=0.08866, flops=0.3752, attn_flops=0.1382,
                      step_overhead_s=0.0003245, draft_overhead_s=1.443e-05,
                      layer_overhead_s=5.574e-07, logit_s=4.631e-08,
                      segment_overhead_s=0.02338, overlap_p=1.0),
}

# Hardware without measurements inherits the fractions fitted on this one.
REFERENCE = "gb200"


def efficiency_for(hardware: str) -> Efficiency:
  """Calibrated factors of `hardware`, else those of the reference hardware."""
  return CALIBRATED.get(hardware.lower(), CALIBRATED[REFERENCE])
