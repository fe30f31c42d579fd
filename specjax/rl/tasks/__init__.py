"""Tasks: prompts with verifiable answers, and their reward functions, registered by name.

A task yields `Example`s deterministically from an index (so the data position is one integer that
checkpoints restore exactly), encodes prompts with the policy's tokenizer, and scores completions.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from typing import Any, Callable, Sequence

import numpy as np

from specjax.errors import UserError
from specjax.rl.config import TaskConfig


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str  # text handed to the tokenizer (chat template already applied)
  answer: str  # ground truth
  meta: Any = None


@dataclasses.dataclass(frozen=True)
class Score:
  reward: float
  correct: bool


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: tuple, epoch: int, size: int) -> np.ndarray:
  return np.random.default_rng([*seed, epoch]).permutation(size)


def epoch_index(position: int, size: int, seed: tuple) -> int:
  """Which of `size` items sits at `position` of a sequence of epochs over them, epoch e
  (positions e size .. e size + size - 1) in an order drawn from `seed` and e."""
  return int(_epoch_order(tuple(seed), position // size, size)[position % size])


class Task:
  """Base class: subclasses implement `example(index)`, `validation(n)` and `score`."""

  name = "task"

  def __init__(self, cfg: TaskConfig, tokenizer):
    self.cfg = cfg
    self.tokenizer = tokenizer

  def example(self, index: int) -> Example:
    raise NotImplementedError

  def examples(self, start: int, n: int) -> list[Example]:
    """Training prompts start .. start + n - 1 of the (endless, deterministic) stream."""
    return [self.example(start + i) for i in range(n)]

  def train_examples(self, position: int, n: int) -> list[Example]:
    """The RL run's prompts at data positions position .. position + n - 1: the stream's, or
    with TaskConfig.pool_size P, a pool of its examples 0 .. P - 1 visited epoch after epoch
    (epoch e = positions e P .. e P + P - 1, in an order drawn from the task seed and e)."""
    if not self.cfg.pool_size:
      return self.examples(position, n)  # (a task that overrides `examples` keeps its stream)
    return [self.example(self.pool_index(position + i)) for i in range(n)]

  def pool_index(self, position: int) -> int:
    """The example at data position `position` (TaskConfig.pool_size)."""
    size = self.cfg.pool_size
    return epoch_index(position, size, (self.cfg.seed, 7919)) if size else position

  def validation(self, n: int) -> list[Example]:
    raise NotImplementedError

  def score(self, completion: str, example: Example) -> Score:
    raise NotImplementedError

  def encode_prompt(self, example: Example) -> list[int]:
    bos = getattr(self.tokenizer, "bos_id", None) is not None
    return self.tokenizer.encode(example.prompt, bos=bos)


@dataclasses.dataclass
class RewardBatch:
  rewards: np.ndarray  # float32[N]
  correct: np.ndarray  # bool[N]
  errors: list[str]  # one message per completion whose scoring raised


def compute_rewards(score: Callable[[str, Example], Score], completions: Sequence[str],
                    examples: Sequence[Example]) -> RewardBatch:
  """Score every completion; a scorer that raises gives reward 0 and an error message instead of
  stopping the loop."""
  rewards = np.zeros(len(completions), np.float32)
  correct = np.zeros(len(completions), bool)
  errors = []
  for i, (text, ex) in enumerate(zip(completions, examples)):
    try:
      s = score(text, ex)
      rewards[i], correct[i] = float(s.reward), bool(s.correct)
    except Exception as e:  # noqa: BLE001 - a verifier must never crash the run
      tb = traceback.format_exception_only(type(e), e)[-1].strip()
      errors.append(f"sample {i} (answer {ex.answer!r}): {tb}")
  return RewardBatch(rewards, correct, errors)


def _arithmetic(cfg, tok):
  from specjax.rl.tasks.arithmetic import ArithmeticTask
  return ArithmeticTask(cfg, tok)


def _chain(cfg, tok):
  from specjax.rl.tasks.chain import ChainTask
  return ChainTask(cfg, tok)


def _trace(cfg, tok):
  from specjax.rl.tasks.trace import TraceTask
  return TraceTask(cfg, tok)


def _trace_long(cfg, tok):
  from specjax.rl.tasks.trace import LongTraceTask
  return LongTraceTask(cfg, tok)


def _math(fmt):
  def build(cfg, tok):
    from specjax.rl.tasks.math_data import MathDatasetTask
    return MathDatasetTask(dataclasses.replace(cfg, format=fmt) if fmt else cfg, tok)
  return build


def _word_problems(cfg, tok):
  from specjax.rl.tasks.word_problems import WordProblemTask
  return WordProblemTask(cfg, tok)


def _reasoning_gym(cfg, tok):
  from specjax.rl.tasks.reasoning_gym import ReasoningGymTask
  return ReasoningGymTask(cfg, tok)


TASKS: dict[str, Callable[[TaskConfig, Any], Task]] = {
    "arithmetic": _arithmetic,
    "chain": _chain,
    "trace": _trace,
    "trace-long": _trace_long,
    "math": _math(None),
    "gsm8k": _math("gsm8k"),
    "dapo": _math("dapo"),
    "reasoning_gym": _reasoning_gym,
    "word_problems": _word_problems,
}


def register_task(name: str, builder: Callable[[TaskConfig, Any], Task]) -> None:
  TASKS[name] = builder


def make_task(cfg: TaskConfig, tokenizer) -> Task:
  if cfg.name not in TASKS:
    raise UserError(f"TaskConfig.name: must be one of {sorted(TASKS)}, got {cfg.name!r}")
  return TASKS[cfg.name](cfg, tokenizer)


__all__ = ["Example", "Score", "Task", "RewardBatch", "compute_rewards", "TASKS", "register_task",
           "make_task"]
