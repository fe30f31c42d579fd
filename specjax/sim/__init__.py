"""specjax.sim: a first-principles performance simulator of RL steps with speculative rollouts.

Pure numpy (never imports jax). Entry points: `Scenario` + `compare`, `project_scaled`, `advise`,
and experiments/simulate.py. Rollout engines: `ENGINE_KINDS` (vLLM-like, specjax's dense
engine, specjax's queue-fed paged engine).
"""

from specjax.sim.advise import advise
from specjax.sim.bench_data import cases_from_benchmark_json
from specjax.sim.calibrate import MeasuredCase, fit_efficiency, paper_cases
from specjax.sim.catalog import (HARDWARE, MODELS, HardwareSpec, ModelSpec, get_hardware,
                                 get_model, load_catalog)
from specjax.sim.continuous_model import (ContinuousEngineConfig, ContinuousRun,
                                          simulate_continuous)
from specjax.sim.cost import Efficiency
from specjax.sim.drafter_costs import DRAFTER_COSTS, DrafterCost, get_drafter_cost
from specjax.sim.engine_model import EngineModelConfig, EngineModelRun, simulate_engine
from specjax.sim.factors import efficiency_for
from specjax.sim.scaled import project_scaled
from specjax.sim.simulate import (ENGINE_KINDS, Comparison, Scenario, StepResult, compare,
                                  simulate_step)
from specjax.sim.workload import WORKLOADS, Workload, get_workload

__all__ = [
    "Comparison", "ContinuousEngineConfig", "ContinuousRun", "DRAFTER_COSTS", "DrafterCost",
    "ENGINE_KINDS", "Efficiency", "EngineModelConfig", "EngineModelRun", "HARDWARE",
    "HardwareSpec", "MODELS", "MeasuredCase", "ModelSpec", "Scenario", "StepResult", "WORKLOADS",
    "Workload", "advise", "cases_from_benchmark_json", "compare", "efficiency_for",
    "fit_efficiency", "get_drafter_cost", "get_hardware", "get_model", "get_workload",
    "load_catalog", "paper_cases", "project_scaled", "simulate_continuous", "simulate_engine",
    "simulate_step",
]
