"""Async RL takes RLConfig.minibatches optimizer steps per batch, and what its resume does: the
queued batches are regenerated from the restored (newest) parameters, same prompts, version gap 0."""

import jax
import pytest
from flax import nnx

from specjax.models import CharTokenizer, Decoder, ModelConfig
from specjax.optim import OptimConfig, make_schedule
from specjax.rl.async_rl.config import AsyncConfig
from specjax.rl.async_rl.loop import run_rl_async
from specjax.rl.config import (
  CheckpointConfig,
  RLConfig,
  RolloutConfig,
)
from specjax.rl.grpo import GRPOConfig
from specjax.rl.metrics_log import read_metrics
from specjax.rl.tasks.arithmetic import ArithmeticTask

TOK = CharTokenizer()
MODEL = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=16, mlp_hidden=64)
CFG = RLConfig(model=MODEL, grpo=GRPOConfig(group_size=4), prompts_per_step=4, steps=3,
               minibatches=2, rollout=RolloutConfig(max_new_tokens=3),
               policy_optim=OptimConfig(lr=1e-3, schedule="linear", final_lr_ratio=0.0),
               checkpoint=CheckpointConfig(every=1, save_on_exit=True), progress=False,
               tensorboard=False)


@pytest.mark.slow
def test_async_minibatches_and_resume_regenerates_queued_batches_from_restored_params(tmp_path):
  policy = nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))
  lag = AsyncConfig(policy_lag=1, is_correction=False)
  run = lambda stop: run_rl_async(CFG.replace(steps=stop), lag, policy, TOK,
                                  ArithmeticTask(CFG.task, TOK), out_dir=str(tmp_path),
                                  verbose=False, devices=jax.devices()[:2])
  first = run(2)  # interrupted after 2 of 3 steps (checkpoint at step 2)
  assert int(first["state"].step) == 2 * CFG.minibatches  # two optimizer steps per batch
  resumed = run(3)
  assert resumed["start_step"] == 2 and int(resumed["state"].step) == 3 * CFG.minibatches
  records = read_metrics(resumed["metrics_path"])
  by_step = {r["step"]: r for r in records}
  # the schedule spans steps x minibatches optimizer steps, and the last batch's two steps are
  # optimizer steps 4 and 5 of 6: their mean learning rate is logged
  sched = make_schedule(CFG.policy_optim, CFG.optimizer_steps)
  assert CFG.optimizer_steps == 6
  assert abs(by_step[3]["lr/policy"] - (float(sched(4)) + float(sched(5))) / 2) < 1e-9
  # uninterrupted, batch 2 would come from params version 1 (lag 1); after the resume the queue
  # starts empty and batch 2 is generated from the restored version 2: gap 0, same prompts
  assert by_step[3]["async/version_gap"] == 0
  assert by_step[3]["data/position"] == 3 * CFG.prompts_per_step
