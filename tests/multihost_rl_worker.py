"""One process of the 2-process RL test (tests/test_multihost.py), started by launch_local.py.

Joins the job and runs the synchronous RL loop with an online EAGLE-3 draft on one 4-device mesh
whose tensor axis spans both processes: one step, then SIGTERM to process 0 only (both processes
must agree to stop after that step and checkpoint it), then a second call that resumes from it
(past a half-written checkpoint of step 2, as a crash leaves it) for the second step.
Writes each step's metrics and the final parameters (gathered to the host) to
OUT_DIR/rl_p{process_id}.npz. `run` with use_mesh=False is the single-process reference.
"""

from __future__ import annotations

import os
import sys

import numpy as np

# tensor=4 splits the heads and the MLP (policy and draft head, with their Adam moments) across
# the two processes. The batch stays whole on every device: rows split over processes (data or
# fsdp across them) would need the rollout engine to gather its per-segment summary across
# processes, which it does not do (the engine fetches it with jax.device_get).
MESH_SHAPE = (1, 1, 4)
STEPS = 2
# Compared exactly: they follow from the sampled tokens alone. The random draws do not depend on
# the sharding (partitionable threefry), and float32 noise of ~1e-7 would have to move a draw
# across a decision boundary to change a token: with fixed seeds that fails every time or never.
EXACT_METRICS = ("reward/mean", "reward/std", "gen/tokens", "spec/num_drafts",
                 "spec/acceptance_length", "data/position")
CLOSE_METRICS = ("pg_loss", "entropy", "draft/loss", "grad_norm/policy", "grad_norm/draft")


def model_config():
  from specjax.models import CharTokenizer, ModelConfig
  return ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, mlp_hidden=64)


def rl_config(use_mesh: bool):
  from specjax.optim import OptimConfig
  from specjax.rl.config import CheckpointConfig, DraftConfig, RLConfig, RolloutConfig
  from specjax.rl.grpo import GRPOConfig
  from specjax.sharding import MeshConfig
  # a fixed K and no compaction: one segment program per rollout, the fewest compiles
  return RLConfig(model=model_config(), grpo=GRPOConfig(group_size=4), prompts_per_step=4,
                  steps=STEPS,
                  rollout=RolloutConfig(max_new_tokens=4, engine=RolloutConfig.engine.replace(
                      buckets=dict(compaction=False), adaptive=dict(enabled=False))),
                  draft=DraftConfig(kind="eagle3", draft_len=2, online=True, ttt_steps=2),
                  policy_optim=OptimConfig(lr=1e-3), draft_optim=OptimConfig(lr=1e-3),
                  checkpoint=CheckpointConfig(every=1), mesh=MeshConfig(*MESH_SHAPE),
                  use_mesh=use_mesh, progress=False, tensorboard=False)


def _numpy_init(module_fn, seed: int):
  """(graphdef, state) with weights drawn by numpy: identical in every process, and no
  random-number programs to compile (they dominate a tiny model's start-up)."""
  import jax
  from flax import nnx
  graphdef, abstract = nnx.split(nnx.eval_shape(module_fn))
  rng = np.random.default_rng(seed)

  def draw(x):
    noise = rng.standard_normal(x.shape).astype(np.float32)
    return 1.0 + 0.1 * noise if len(x.shape) == 1 else 0.1 * noise  # norm scales near one

  return graphdef, jax.tree.map(draw, abstract)


def policy_and_head():
  from flax import nnx
  from specjax.drafters.head import init_head
  from specjax.models import Decoder
  cfg = model_config()
  return (_numpy_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), 0),
          _numpy_init(lambda: init_head(cfg), 1))


def digit_task(cfg):
  """Arithmetic prompts; the reward is the share of digits in the completion, so a random policy
  already gets rewards that differ within a group and its update (not only the draft's) is
  non-zero from the first step."""
  from specjax.models import CharTokenizer
  from specjax.rl.tasks import Score
  from specjax.rl.tasks.arithmetic import ArithmeticTask

  class DigitShare(ArithmeticTask):
    def score(self, completion, example):
      share = sum(c.isdigit() for c in completion) / cfg.rollout.max_new_tokens
      return Score(reward=share, correct=completion.strip() == example.answer)

  return DigitShare(cfg.task, CharTokenizer())


def run(out_dir: str, *, use_mesh: bool, sigterm_at: int | None = None) -> dict:
  """One `run_rl` call (resuming from the newest checkpoint in out_dir); returns the steps it
  ran, their metrics (EXACT_METRICS + CLOSE_METRICS) and its final parameters on the host.
  `sigterm_at`: process 0 (only) sends itself SIGTERM once that step is done; the call then
  returns the step every process stopped after ("stopped") and no parameters."""
  import signal

  import jax
  from jax.experimental import multihost_utils
  from specjax.models import CharTokenizer
  from specjax.rl.loop import run_rl
  from specjax.rl.preemption import Preempted

  cfg = rl_config(use_mesh)
  policy, head = policy_and_head()
  records = []

  def record(step, m):
    records.append((step, m))
    if step == sigterm_at and jax.process_index() == 0:
      os.kill(os.getpid(), signal.SIGTERM)

  def metrics():
    return np.array([[m[k] for k in EXACT_METRICS + CLOSE_METRICS] for _, m in records],
                    np.float64)

  try:
    summary = run_rl(cfg, policy, CharTokenizer(), digit_task(cfg), out_dir=out_dir, draft=head,
                     verbose=False, hooks=[record])
  except Preempted as stop:
    return {"start": records[0][0] - 1, "steps": np.array([s for s, _ in records]),
            "metrics": metrics(), "stopped": stop.step}
  params = jax.tree.leaves(summary["state"].params)
  split = sum(not x.is_fully_addressable and not x.is_fully_replicated for x in params)
  return {"start": summary["start_step"], "steps": np.array([s for s, _ in records]),
          "split_leaves": split, "metrics": metrics(), "stopped": -1,
          "params": [np.asarray(multihost_utils.process_allgather(x, tiled=True))
                     for x in params]}


def reference(out_dir: str) -> dict:
  """The same run in one process on one device, uninterrupted."""
  return run(out_dir, use_mesh=False)


def main(out_dir: str) -> None:
  # Compiling dominates a run this small and XLA's backend optimisations only cost compile time
  # here (both calls, measured on 2 cores: 26 s instead of 49 s; the results agree with the
  # reference to ~1e-7 either way).
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                      "--xla_backend_optimization_level=0"]).strip()
  from specjax.sharding import DistributedConfig, initialize_distributed
  assert initialize_distributed(DistributedConfig.from_env()), "expected a multi-process job"

  import jax
  from jax.experimental import multihost_utils
  assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
  run_dir = os.path.join(out_dir, "run")  # shared by both processes, as on a shared filesystem
  first = run(run_dir, use_mesh=True, sigterm_at=1)  # both processes stop after step 1
  if jax.process_index() == 0:  # a crash while step 2 was being saved left it half-written
    os.makedirs(os.path.join(run_dir, "checkpoints", str(STEPS), "state"))
  multihost_utils.sync_global_devices("half-written checkpoint planted")
  second = run(run_dir, use_mesh=True)  # moves it aside, resumes from step 1, saves step 2 anew
  np.savez(os.path.join(out_dir, f"rl_p{jax.process_index()}.npz"),
           starts=np.array([first["start"], second["start"]]), stopped=first["stopped"],
           split_leaves=second["split_leaves"],
           steps=np.concatenate([first["steps"], second["steps"]]),
           metrics=np.concatenate([first["metrics"], second["metrics"]]),
           **{f"param{i:03d}": x for i, x in enumerate(second["params"])})
  print(f"process {jax.process_index()} done: steps {first['steps']} + {second['steps']}",
        flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1])
