"""The embedded reasoning task: a running sum, one digit at a time, written out as a scratchpad.

Prompt "3+5+2+8=", completion "3+5=8,8+2=0,0+8=8#8": each step adds the next operand to the
running sum and keeps its last digit; the answer follows '#'. The number of operands is
log-uniform on [2, cfg.operands], so completion lengths are long-tailed like reasoning traces
(a few to ~140 tokens at 25 operands). Character-level text for `specjax.models.CharTokenizer`.
"""

from __future__ import annotations

import math

import numpy as np

from specjax.errors import UserError
from specjax.rl.config import TaskConfig
from specjax.rl.tasks import Example, Score, Task

_TRAIN, _VALID = 0, 1  # independent random streams
STEP_CHARS = 6  # "a+x=r,"


class ScratchpadTask(Task):
  """A task whose completion is a scratchpad ending in "#<answer>": examples from two independent
  random streams (training, validation) by `_make(stream, index)`; the reward is the answer after
  the last "#" (plus `format_reward`). Subclasses write `_make` and the length bounds."""

  def _make(self, stream: int, index: int) -> Example:
    raise NotImplementedError

  def example(self, index: int) -> Example:
    return self._make(_TRAIN, index)

  def validation(self, n: int) -> list[Example]:
    return [self._make(_VALID, i) for i in range(n)]

  @staticmethod
  def scratchpad(example: Example) -> str:
    return example.meta["scratchpad"]

  def score(self, completion: str, example: Example) -> Score:
    if "#" not in completion:
      return Score(reward=0.0, correct=False)
    correct = completion.rsplit("#", 1)[1].strip() == example.answer
    return Score(reward=float(correct) + self.cfg.format_reward, correct=correct)


class ChainTask(ScratchpadTask):
  name = "chain"

  def __init__(self, cfg: TaskConfig = TaskConfig(operands=25), tokenizer=None):
    if tokenizer is None:
      from specjax.models.tokenizer import CharTokenizer
      tokenizer = CharTokenizer()
    if cfg.operands < 2:
      raise UserError(f"TaskConfig.operands: the chain task needs >= 2, got {cfg.operands}")
    super().__init__(cfg, tokenizer)

  def _make(self, stream: int, index: int) -> Example:
    rng = np.random.default_rng([self.cfg.seed, stream, index])
    n = int(math.floor(2 * math.exp(rng.random() * math.log((self.cfg.operands + 1) / 2))))
    n = min(max(n, 2), self.cfg.operands)
    xs = [int(v) for v in rng.integers(0, 10, size=n)]
    steps, acc = [], xs[0]
    for x in xs[1:]:
      new = (acc + x) % 10
      steps.append(f"{acc}+{x}={new}")
      acc = new
    return Example(prompt="+".join(map(str, xs)) + "=", answer=str(acc),
                   meta={"operands": xs, "scratchpad": ",".join(steps) + f"#{acc}"})


  @property
  def max_completion_len(self) -> int:
    """Characters of the longest completion, EOS included."""
    return STEP_CHARS * (self.cfg.operands - 1) - 1 + 2 + 1

  @property
  def max_prompt_len(self) -> int:
    return 2 * self.cfg.operands + 1  # digits and '+', '=' , BOS
