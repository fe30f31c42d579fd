"""RL-Think: GRPO from a model fine-tuned to write a step-by-step scratchpad before its answer.

Same AR-vs-speculative comparison as rl_zero.py, on longer and harder-to-predict completions
("12+7-5=" -> "12+7=19,19-5=14#14"): expect a lower acceptance length than RL-Zero. Several RL
seeds per arm: `python experiments/rl_zero_seeds.py --experiment rl_think --seeds 0 1 2 3`.
"""

from __future__ import annotations

import numpy as np

from specjax.errors import UserError
from specjax.jobs import run_main, setup_logging
from specjax.jobs.base_policy import biased_answer
from specjax.jobs.config import BaseModelConfig, DraftInitConfig, ExperimentConfig, parse_config
from specjax.jobs.driver import run_experiment
from specjax.models import ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.config import (CheckpointConfig, DraftConfig, RLConfig, RolloutConfig, TaskConfig,
                               ValidationConfig)
from specjax.rl.grpo import GRPOConfig
from specjax.rl.tasks import Example, Score, register_task
from specjax.rl.tasks.arithmetic import ArithmeticTask


class ScratchpadArithmeticTask(ArithmeticTask):
  """Left-to-right + and - chains; the completion shows each partial result, then `#answer`."""

  name = "arithmetic-think"

  def __init__(self, cfg, tokenizer=None):
    if set(cfg.operators) - set("+-"):
      raise UserError(f"TaskConfig.operators: arithmetic-think supports '+' and '-' only, "
                      f"got {cfg.operators!r}")
    super().__init__(cfg, tokenizer)

  @staticmethod
  def scratchpad(example: Example) -> str:
    xs, ops = example.meta["operands"], example.meta["operators"]
    steps, acc = [], xs[0]
    for op, x in zip(ops, xs[1:]):
      new = acc + x if op == "+" else acc - x
      steps.append(f"{acc}{op}{x}={new}")
      acc = new
    return ",".join(steps) + f"#{acc}"

  def score(self, completion: str, example: Example) -> Score:
    if "#" not in completion:
      return Score(reward=0.0, correct=False)
    correct = completion.rsplit("#", 1)[1].strip() == example.answer
    return Score(reward=float(correct) + self.cfg.format_reward, correct=correct)


register_task("arithmetic-think", lambda cfg, tok: ScratchpadArithmeticTask(cfg, tok))


def answer_examples(task, n: int, seed: int, bias: float) -> list[tuple[str, str]]:
  rng = np.random.default_rng(seed)
  return [(e.prompt, biased_answer(e, rng, bias))
          for e in task.examples(50_000_000 + 100_000 * seed, n)]


def scratchpad_examples(task, n: int, seed: int, bias: float) -> list[tuple[str, str]]:
  """Scratchpad text; with probability `bias` the final answer carries the base model's mistake."""
  rng = np.random.default_rng(seed)
  out = []
  for e in task.examples(60_000_000 + 100_000 * seed, n):
    pad = task.scratchpad(e)
    out.append((e.prompt, pad.rsplit("#", 1)[0] + "#" + biased_answer(e, rng, bias)))
  return out


def _defaults() -> ExperimentConfig:
  """A 0.15M-parameter decoder pretrained on answers, fine-tuned on 3-operand scratchpads
  (~16 tokens): short completions, so the plain loop (no compaction, fixed K; docs/BENCHMARKS.md,
  "RL-Think"). rl_zero.py's default is the long-scratchpad job.

  1500 fine-tuning steps: after 300 the base could not copy the prompt's operands into its
  scratchpad (no greedy scratchpad right on 256 held-out prompts, sampled accuracy 0.07), and RL
  had nothing to reinforce (accuracy flat or falling over 60 steps, docs/BENCHMARKS.md). After
  1500, 95% of greedy scratchpads are right and only the biased final answer is wrong, which RL
  learns to fix."""
  return ExperimentConfig(
      name="rl_think",
      base=BaseModelConfig(steps=300, examples=4000, batch_size=64, lr=3e-3, bias=0.7,
                           finetune_steps=1500),
      draft_init=DraftInitConfig(steps=200, prompts=256, batch_size=32),
      rl=RLConfig(
          model=ModelConfig(vocab_size=64, hidden_size=64, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=16, mlp_hidden=128, tie_embeddings=True),
          task=TaskConfig(name="arithmetic-think", digits=1, operands=3, operators="+-"),
          grpo=GRPOConfig(group_size=8),
          policy_optim=OptimConfig(lr=3e-4, warmup_steps=2, clip_norm=1.0),
          draft_optim=OptimConfig(lr=1e-3, clip_norm=1.0),
          draft=DraftConfig(kind="eagle3", draft_len=3, online=True, loss_weight=1.0),
          rollout=RolloutConfig(temperature=1.0, max_new_tokens=24,
                                engine=RolloutConfig.engine.replace(
                                    buckets=dict(compaction=False), adaptive=dict(enabled=False))),
          validation=ValidationConfig(every=10, num_prompts=128, batch_size=128),
          checkpoint=CheckpointConfig(every=20),
          steps=60, prompts_per_step=16, seed=0, progress=True))


DEFAULTS = _defaults()


def main(argv=None) -> dict:
  setup_logging()
  cfg = parse_config(DEFAULTS, argv)
  from specjax.sharding import initialize_distributed

  initialize_distributed()
  return run_experiment(cfg, base_examples=answer_examples,
                        finetune_examples=scratchpad_examples)


if __name__ == "__main__":
  # a user's mistake, a failed write or a stop: one line on stderr and an exit code (README)
  run_main(main)
