"""GRPO with speculative rollouts: config, loss, the SPMD train step, the sync loop, checkpoints,
metrics and tasks (async RL in `specjax.rl.async_rl`). Names below are imported lazily
(`from specjax.rl import run_rl`).
"""

import importlib

_EXPORTS = {
    "RLConfig": "config", "DraftConfig": "config", "RolloutConfig": "config",
    "TrainConfig": "config", "TaskConfig": "config", "ValidationConfig": "config",
    "CheckpointConfig": "config", "load_config": "config", "GRPOConfig": "grpo",
    "group_advantages": "grpo", "grpo_loss": "grpo", "register_advantage": "grpo",
    "ADVANTAGES": "grpo",
    "Trainer": "train_step", "TrainStepConfig": "train_step", "TrainBatch": "train_step",
    "TrainState": "train_step", "build_train_batch": "batch", "rollout_metrics": "batch",
    "run_rl": "loop", "setup_run": "loop", "rl_step": "loop", "validate": "loop",
    "RolloutSampler": "rollout", "Checkpointer": "checkpoint", "MetricsLogger": "metrics_log",
    "read_metrics": "metrics_log", "PhaseTimer": "timing",
    "make_task": "tasks", "TASKS": "tasks",
}


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'specjax.rl' has no attribute {name!r}")
  return getattr(importlib.import_module(f"specjax.rl.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
