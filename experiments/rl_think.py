"""RL-Think: GRPO from a model fine-tuned to write a step-by-step scratchpad before its answer.

Same AR-vs-speculative comparison as rl_zero.py, on longer and harder-to-predict completions
("12+7-5=" -> "12+7=19,19-5=14#14"): expect a lower acceptance length than RL-Zero.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.experiment.driver import ExperimentConfig, biased_answer, parse_config, run_experiment
from specjax.rl.tasks import Example, Score, register_task
from specjax.rl.tasks.arithmetic import ArithmeticTask


class ScratchpadArithmeticTask(ArithmeticTask):
  """Left-to-right + and - chains; the completion shows each partial result, then `#answer`."""

  name = "arithmetic-think"

  def __init__(self, cfg, tokenizer=None):
    if set(cfg.operators) - set("+-"):
      raise ValueError(f"TaskConfig.operators: arithmetic-think supports '+' and '-' only, "
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
  """rl_zero's embedded default, with a scratchpad fine-tune, 3-operand chains and longer outputs."""
  from rl_zero import DEFAULTS as ZERO

  rl = ZERO.rl
  return dataclasses.replace(
      ZERO, name="rl_think",
      base=dataclasses.replace(ZERO.base, finetune_steps=300),
      rl=dataclasses.replace(
          rl, task=dataclasses.replace(rl.task, name="arithmetic-think", digits=1, operands=3,
                                       operators="+-"),
          rollout=dataclasses.replace(rl.rollout, max_new_tokens=24)))


DEFAULTS = _defaults()


def main(argv=None) -> dict:
  cfg = parse_config(DEFAULTS, argv)
  from specjax.sharding import initialize_distributed

  initialize_distributed()
  return run_experiment(cfg, base_examples=answer_examples, finetune_examples=scratchpad_examples)


if __name__ == "__main__":
  main()
