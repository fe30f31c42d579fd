"""RL-Zero: GRPO from a weak base model, AR rollouts vs speculative (EAGLE-3) rollouts side by side.

`python experiments/rl_zero.py` runs the embedded default (arithmetic, a tiny decoder pretrained
here, CPU, no downloads) and writes runs/rl_zero/: metrics JSONL of both runs, summary.json, plots.
Every knob is a flag (`--help`), or a YAML file (`--config my.yaml`); `--model-path` takes a local
Hugging Face checkpoint and `--dataset` a local JSONL/parquet math set.
"""

from __future__ import annotations

import numpy as np

from specjax.experiment.driver import (BaseModelConfig, DraftInitConfig, ExperimentConfig,
                                       biased_answer, parse_config, run_experiment)
from specjax.models import ModelConfig
from specjax.rl.config import (DraftConfig, GRPOConfig, OptimConfig, RLConfig, RolloutConfig,
                               TaskConfig, ValidationConfig, CheckpointConfig)


def answer_examples(task, n: int, seed: int, bias: float) -> list[tuple[str, str]]:
  """Base-model text: the task's prompts (a stream RL never uses) with mostly biased answers.
  Tasks that write a scratchpad (`--rl.task.name chain`) get it, with the final answer one too
  high (mod 10) with probability `bias`."""
  rng = np.random.default_rng(seed)
  out = []
  for e in task.examples(50_000_000 + 100_000 * seed, n):
    if hasattr(task, "scratchpad"):
      pad, answer = task.scratchpad(e).rsplit("#", 1)
      wrong = rng.random() < bias
      out.append((e.prompt, f"{pad}#{(int(answer) + 1) % 10 if wrong else answer}"))
    else:
      out.append((e.prompt, biased_answer(e, rng, bias)))
  return out


DEFAULTS = ExperimentConfig(
    name="rl_zero",
    base=BaseModelConfig(steps=300, examples=4000, batch_size=64, lr=3e-3, bias=0.7),
    draft_init=DraftInitConfig(steps=200, prompts=256, batch_size=32),
    rl=RLConfig(
        model=ModelConfig(vocab_size=64, hidden_size=64, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=16, mlp_hidden=128, tie_embeddings=True),
        task=TaskConfig(name="arithmetic", digits=1, operands=2, operators="+*"),
        grpo=GRPOConfig(group_size=8),
        policy_optim=OptimConfig(lr=3e-4, warmup_steps=2, clip_norm=1.0),
        draft_optim=OptimConfig(lr=1e-3, clip_norm=1.0),
        draft=DraftConfig(kind="eagle3", draft_len=3, online=True, loss_weight=1.0,
                          adaptive=False),
        # 3-token answers on 128 rows finish in ~10 ms: the engine's segments (a host round trip
        # each, one compiled program per bucket and K) cost more than compaction and adaptive K
        # save here (docs/BENCHMARKS.md), so this job runs the plain loop; long-tailed
        # completions are where the engine pays (bench_engine.py)
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=8, compaction=False),
        validation=ValidationConfig(every=10, num_prompts=128, batch_size=128),
        checkpoint=CheckpointConfig(every=20),
        steps=60, prompts_per_step=16, seed=0, progress=True),
)


def main(argv=None) -> dict:
  cfg = parse_config(DEFAULTS, argv)
  from specjax.sharding import initialize_distributed

  initialize_distributed()
  return run_experiment(cfg, base_examples=answer_examples)


if __name__ == "__main__":
  main()
