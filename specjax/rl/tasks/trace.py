"""The embedded reasoning task of the main job: a Fibonacci-style recurrence mod 10, traced.

Prompt "d3+5=", completion "8,c5+8=3,b8+3=1,a3+1=4#4": the prompt is the first step of a
recurrence mod 10 (terms 3, 5); each step copies the two terms before it and writes their sum
mod 10; steps count down by letter from the one the prompt names to 'a'; the answer (the last
term) follows '#'.

Why this shape: every scratchpad token is a function of tokens a fixed distance back (both copies
5 back, the next letter 7 back, the sum from 2 and 4 back, '#' after the step named 'a'), which
a small decoder learns in a few hundred steps and a cheap draft predicts; the answer depends on
every step. Three earlier layouts were not learned by a 0.75-1.2M decoder in 300-400 steps: a
running sum over operands listed in the prompt (an induction-head lookup per step), counting up
to a letter named in the prompt (the stop needs a lookup in the prompt), and a prompt "35:d="
whose first letter is a copy at an offset no other step uses. The number of steps is log-uniform
on [2, cfg.operands] (at most 26: letters z..a), so completion lengths are long-tailed like
reasoning traces: 11 to 7 * steps - 3 tokens with EOS (165 at 24 steps; median ~5 steps).
Character-level text for `specjax.models.CharTokenizer`. `trace-long` (`LongTraceTask`) labels its
steps with two letters ("ab3+5=8,aa5+8=3#3", up to 676 steps) for traces of a thousand tokens
and more.
"""

from __future__ import annotations

import math
import string

import numpy as np

from specjax.errors import UserError
from specjax.rl.config import TaskConfig
from specjax.rl.tasks import Example
from specjax.rl.tasks.chain import ScratchpadTask

LABELS = string.ascii_lowercase
MAX_STEPS = len(LABELS)
STEP_CHARS = 7  # "c3+5=8,"


LONG_LABELS = tuple(x + y for x in LABELS for y in LABELS)  # "aa", "ab", ..., "zz"


def trace_text(a: int, b: int, steps: int, labels=LABELS) -> str:
  """The whole trace (prompt and completion): trace_text(3, 5, 2) == "b3+5=8,a5+8=3#3"."""
  out = []
  for label in labels[steps - 1::-1]:
    out.append(f"{label}{a}+{b}={(a + b) % 10}")
    a, b = b, (a + b) % 10
  return ",".join(out) + f"#{b}"


class TraceTask(ScratchpadTask):
  name = "trace"
  labels = LABELS  # one per step, counted down to the first
  label_names = "letters z..a"

  def __init__(self, cfg: TaskConfig = TaskConfig(operands=MAX_STEPS), tokenizer=None):
    if tokenizer is None:
      from specjax.models.tokenizer import CharTokenizer
      tokenizer = CharTokenizer()
    if not 2 <= cfg.operands <= len(self.labels):
      raise UserError(f"TaskConfig.operands: the {self.name} task takes 2..{len(self.labels)} "
                      f"steps ({self.label_names}), got {cfg.operands}")
    super().__init__(cfg, tokenizer)

  def _make(self, stream: int, index: int) -> Example:
    rng = np.random.default_rng([self.cfg.seed, stream, index])
    n = int(math.floor(math.exp(rng.random() * math.log(self.cfg.operands + 1))))
    n = min(max(n, 2), self.cfg.operands)
    a, b = (int(v) for v in rng.integers(0, 10, size=2))
    text = trace_text(a, b, n, self.labels)
    prompt = f"{self.labels[n - 1]}{a}+{b}="
    return Example(prompt=prompt, answer=text.rsplit("#", 1)[1],
                   meta={"steps": n, "scratchpad": text[len(prompt):]})


  @property
  def max_completion_len(self) -> int:
    """Tokens of the longest completion, EOS included: every step's label and "a+b=s,", minus
    the prompt's step and the last comma, then "#s" and EOS."""
    label = len(self.labels[0])
    return (STEP_CHARS - 1 + label) * self.cfg.operands - label - 2

  @property
  def max_prompt_len(self) -> int:
    return 5 + len(self.labels[0])  # BOS and the first step "d3+5="


class LongTraceTask(TraceTask):
  """The trace with two-letter step labels counted down to "aa" ("ac3+5=8,ab5+8=3,aa8+3=1#1"):
  up to 676 steps, completions of a thousand tokens and more at 130 steps."""

  name = "trace-long"
  labels = LONG_LABELS
  label_names = "two letters, zz..aa"
