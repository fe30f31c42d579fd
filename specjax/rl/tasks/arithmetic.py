"""The embedded arithmetic task: procedural expressions like "12+7=" answered "19<eos>".

Difficulty knob: digits per operand, number of operands and the operator set; character-level text
for `specjax.models.CharTokenizer`. Reward: exact answer (+ optional format bonus).
"""

from __future__ import annotations

import re

import numpy as np

from specjax.rl.config import TaskConfig
from specjax.rl.tasks import Example, Score, Task

_INT = re.compile(r"-?\d+")
_TRAIN, _VALID = 0, 1  # independent random streams


def evaluate(operands: list[int], operators: list[str]) -> int:
  """Value with the usual precedence (* before + and -), left to right otherwise."""
  terms, signs = [operands[0]], []
  for op, x in zip(operators, operands[1:]):
    if op == "*":
      terms[-1] *= x
    else:
      terms.append(x)
      signs.append(1 if op == "+" else -1)
  return terms[0] + sum(s * t for s, t in zip(signs, terms[1:]))


class ArithmeticTask(Task):
  name = "arithmetic"

  def __init__(self, cfg: TaskConfig = TaskConfig(), tokenizer=None):
    if tokenizer is None:
      from specjax.models.tokenizer import CharTokenizer
      tokenizer = CharTokenizer()
    super().__init__(cfg, tokenizer)

  def _make(self, stream: int, index: int) -> Example:
    cfg = self.cfg
    rng = np.random.default_rng([cfg.seed, stream, index])
    xs = [int(v) for v in rng.integers(0, 10**cfg.digits, size=cfg.operands)]
    ops = [cfg.operators[int(i)] for i in rng.integers(0, len(cfg.operators), cfg.operands - 1)]
    expr = str(xs[0]) + "".join(f"{o}{x}" for o, x in zip(ops, xs[1:]))
    return Example(prompt=expr + "=", answer=str(evaluate(xs, ops)),
                   meta={"operands": xs, "operators": ops})

  def example(self, index: int) -> Example:
    return self._make(_TRAIN, index)

  def validation(self, n: int) -> list[Example]:
    return [self._make(_VALID, i) for i in range(n)]

  def score(self, completion: str, example: Example) -> Score:
    text = completion.strip()
    correct = text == example.answer
    well_formed = _INT.fullmatch(text) is not None
    return Score(reward=float(correct) + self.cfg.format_reward * float(well_formed),
                 correct=correct)

  @property
  def max_answer_len(self) -> int:
    """Characters of the longest possible answer (for max_new_tokens: this + 1 for EOS)."""
    cfg = self.cfg
    big = 10**cfg.digits - 1
    worst = big**cfg.operands if "*" in cfg.operators else big * cfg.operands
    return len(str(worst)) + ("-" in cfg.operators)

  @property
  def max_prompt_len(self) -> int:
    return self.cfg.operands * (self.cfg.digits + 1) + 1  # digits, operators, "=", BOS
