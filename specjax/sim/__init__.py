"""specjax.sim: a first-principles performance simulator of RL steps with speculative rollouts.

Pure numpy (never imports jax). Entry points: `Scenario` + `compare`, `project_scaled`, `advise`,
and experiments/simulate.py.
"""

from specjax.sim.calibrate import (MeasuredCase, cases_from_benchmark_json, fit_efficiency,
                                   paper_cases)
from specjax.sim.catalog import (HARDWARE, MODELS, HardwareSpec, ModelSpec, get_hardware,
                                 get_model, load_catalog)
from specjax.sim.cost import Efficiency
from specjax.sim.factors import efficiency_for
from specjax.sim.simulate import Comparison, Scenario, StepResult, compare, simulate_step
from specjax.sim.workload import WORKLOADS, Workload, get_workload
from specjax.sim.engine import EngineConfig, EngineRun, run_engine
from specjax.sim.scaled import project_scaled
from specjax.sim.advise import advise

__all__ = [
    "Comparison", "Efficiency", "EngineConfig", "EngineRun", "advise", "project_scaled",
    "run_engine", "HARDWARE", "HardwareSpec", "MODELS", "MeasuredCase",
    "ModelSpec", "Scenario", "StepResult", "WORKLOADS", "Workload", "cases_from_benchmark_json",
    "compare", "efficiency_for", "fit_efficiency", "get_hardware", "get_model", "get_workload",
    "load_catalog", "paper_cases", "simulate_step",
]
