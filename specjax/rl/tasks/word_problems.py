"""Math word problems made locally, with exact answers: "Mia has 7 pencils. She buys 5 more. How
many pencils does she have now?" answered 12, in the GSM8K style, through the tokenizer's chat
template, scored like the math datasets (`math-verify` on the completion's final answer).

A problem is a story of `TaskConfig.operands - 1` steps over one kind of object, each step adding,
removing or multiplying (`TaskConfig.operators`, "+-*": buys / gives to a friend / ends up with
N times as many), with
quantities of at most `TaskConfig.digits` digits; answers stay positive. The stream is endless and
deterministic (`TaskConfig.seed`); validation problems come from a separate random stream.
`write_jsonl` writes any range of them as GSM8K rows (`question`, `answer` "... #### 12") for the
math dataset task or another engine.
"""

from __future__ import annotations

import json
import os

import numpy as np

from specjax.rl.config import TaskConfig
from specjax.rl.tasks import Example
from specjax.rl.tasks.math_data import ChatMathTask, chat_template_of, render_chat

NAMES = ("Mia", "Tom", "Sara", "Ben", "Lena", "Omar", "Ava", "Leo", "Nina", "Sam", "Zoe", "Raj")
PRONOUN = {"Mia": "She", "Sara": "She", "Lena": "She", "Ava": "She", "Nina": "She", "Zoe": "She"}
OBJECTS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "coins", "cards",
           "shells", "stamps")
# the instruction appended to every question unless TaskConfig.instruction gives another
DEFAULT_INSTRUCTION = "Put the final answer after ####."
_TRAIN, _VALID = 0, 1  # independent random streams


def make_problem(rng: np.random.Generator, steps: int, digits: int,
                 operators: str) -> tuple[str, int]:
  """(question, answer) of a `steps`-step story; every intermediate count stays >= 1."""
  name = NAMES[int(rng.integers(len(NAMES)))]
  he = PRONOUN.get(name, "He")
  obj = OBJECTS[int(rng.integers(len(OBJECTS)))]
  top = 10**digits - 1
  count = int(rng.integers(2, top + 1))
  parts = [f"{name} has {count} {obj}."]
  for _ in range(steps):
    op = operators[int(rng.integers(len(operators)))]
    if op == "-" and count < 2:
      op = "+"
    if op == "+":
      x = int(rng.integers(1, top + 1))
      count += x
      parts.append(f"{he} buys {x} more.")
    elif op == "-":
      x = int(rng.integers(1, min(count - 1, top) + 1))
      count -= x
      parts.append(f"{he} gives {x} to a friend.")
    else:
      x = int(rng.integers(2, min(top, 9) + 1))
      count *= x
      parts.append(f"Then {name} ends up with {x} times as many {obj} as before.")
  parts.append(f"How many {obj} does {name} have now?")
  return " ".join(parts), count


class WordProblemTask(ChatMathTask):
  """GSM8K-style word problems generated from an index (see the module docstring)."""

  name = "word_problems"

  def __init__(self, cfg: TaskConfig = TaskConfig(name="word_problems"), tokenizer=None):
    super().__init__(cfg, tokenizer)
    self.template = chat_template_of(tokenizer) if cfg.chat_template and tokenizer else None
    self.instruction = cfg.instruction or DEFAULT_INSTRUCTION

  def problem(self, stream: int, index: int) -> tuple[str, int]:
    cfg = self.cfg
    rng = np.random.default_rng([cfg.seed, stream, index])
    return make_problem(rng, cfg.operands - 1, cfg.digits, cfg.operators)

  def _example(self, stream: int, index: int) -> Example:
    question, answer = self.problem(stream, index)
    messages = [{"role": "user", "content": f"{question} {self.instruction}"}]
    return Example(prompt=render_chat(messages, self.template, self.tokenizer),
                   answer=str(answer), meta={"question": question})

  def example(self, index: int) -> Example:
    return self._example(_TRAIN, index)

  def validation(self, n: int) -> list[Example]:
    return [self._example(_VALID, i) for i in range(n)]


def write_jsonl(path: str, cfg: TaskConfig, start: int, n: int, validation: bool = False) -> str:
  """Problems start .. start + n - 1 of the training (or validation) stream as GSM8K rows, written
  atomically to `path` (which must not exist: a user's file is never overwritten)."""
  if os.path.exists(path):
    raise FileExistsError(f"write_jsonl: {path} exists")
  task = WordProblemTask(cfg)
  stream = _VALID if validation else _TRAIN
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for i in range(start, start + n):
      question, answer = task.problem(stream, i)
      f.write(json.dumps({"question": question, "answer": f"#### {answer}"}) + "\n")
  os.replace(tmp, path)
  return path
