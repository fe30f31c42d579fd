"""Adapter for reasoning-gym procedural datasets (optional dependency: pip install reasoning-gym).

`TaskConfig.dataset` names the generator (e.g. "chain_sum"); scoring is the dataset's own
`score_answer` on the extracted final answer.
"""

from __future__ import annotations

from specjax.errors import UserError
from specjax.rl.config import TaskConfig
from specjax.rl.tasks import Example, Score, Task
from specjax.rl.tasks.math_data import render_chat
from specjax.rl.tasks.rewards import extract_answer


class ReasoningGymTask(Task):
  name = "reasoning_gym"

  def __init__(self, cfg: TaskConfig, tokenizer):
    super().__init__(cfg, tokenizer)
    try:
      import reasoning_gym
    except ImportError as e:
      raise ImportError("task 'reasoning_gym' needs the optional package reasoning-gym "
                        "(pip install reasoning-gym)") from e
    if not cfg.dataset:
      raise UserError("TaskConfig.dataset: name a reasoning-gym dataset, e.g. 'chain_sum'")
    self.data = reasoning_gym.create_dataset(cfg.dataset, size=cfg.dataset_size, seed=cfg.seed)
    self.val_data = reasoning_gym.create_dataset(cfg.dataset, size=max(cfg.val_size, 1),
                                                 seed=cfg.seed + 1_000_003)
    self.template = getattr(tokenizer, "chat_template", None) if cfg.chat_template else None

  def _example(self, entry) -> Example:
    content = entry["question"] + (f"\n{self.cfg.instruction}" if self.cfg.instruction else "")
    messages = ([{"role": "system", "content": self.cfg.system_prompt}]
                if self.cfg.system_prompt else []) + [{"role": "user", "content": content}]
    return Example(prompt=render_chat(messages, self.template, self.tokenizer),
                   answer=str(entry["answer"]), meta=entry)

  def example(self, index: int) -> Example:
    return self._example(self.data[index % len(self.data)])

  def validation(self, n: int) -> list[Example]:
    return [self._example(self.val_data[i]) for i in range(min(n, len(self.val_data)))]

  def score(self, completion: str, example: Example) -> Score:
    answer = extract_answer(completion)
    reward = 0.0 if answer is None else float(self.data.score_answer(answer=answer,
                                                                     entry=example.meta))
    return Score(reward=reward, correct=reward >= 1.0)
