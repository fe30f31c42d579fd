"""Asynchronous RL: a rollout worker generates on its own device group within a bounded policy lag
while the trainer trains; off-policy batches get truncated importance sampling."""

from specjax.rl.async_rl.config import MAX_POLICY_LAG, AsyncConfig
from specjax.rl.async_rl.importance import tis_weights, weight_metrics
from specjax.rl.async_rl.loop import WeightPush, run_rl_async, setup_async
from specjax.rl.async_rl.worker import RolloutBatch, RolloutWorker, RolloutWorkerError

__all__ = ["AsyncConfig", "MAX_POLICY_LAG", "RolloutBatch", "RolloutWorker", "RolloutWorkerError",
           "WeightPush", "run_rl_async", "setup_async", "tis_weights", "weight_metrics"]
