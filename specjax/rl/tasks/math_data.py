"""Local math datasets (JSONL or parquet) in the GSM8K and DAPO-Math formats, as an RL task.

GSM8K rows: {"question": str, "answer": "... #### 72"}. DAPO-Math-17k rows: {"prompt": [{"role",
"content"}, ...] (or a string), "reward_model": {"ground_truth": str}}. Prompts go through the
tokenizer's chat template when it has one (jinja2); otherwise through `FALLBACK_TEMPLATE`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

import numpy as np

from specjax.rl.config import TaskConfig
from specjax.rl.tasks import Example, Score, Task
from specjax.rl.tasks.rewards import extract_answer, math_verify_reward

# Used when the tokenizer has no chat template (or TaskConfig.chat_template is False): plain
# "Role: content" paragraphs ending with an open assistant turn.
FALLBACK_TEMPLATE = "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n\n" \
                    "{% endfor %}Assistant:"


@dataclasses.dataclass(frozen=True)
class MathRow:
  messages: tuple[dict, ...]  # chat messages of the prompt
  answer: str
  where: str  # "file:line" of the source row


def iter_rows(path: str) -> Iterator[tuple[str, Any]]:
  """(where, row) for every row of a .jsonl/.json-lines or .parquet file."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"math dataset: {path} does not exist")
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq

    for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
      yield f"{path}:{i}", row
    return
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield f"{path}:{i}", json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i}: invalid JSON ({e.msg})") from None


def _field(row: Any, dotted: str, where: str) -> Any:
  cur = row
  for part in dotted.split("."):
    if not isinstance(cur, dict) or part not in cur or cur[part] is None:
      raise ValueError(f"{where}: missing field {dotted!r}")
    cur = cur[part]
  return cur


def gsm8k_answer(answer: str, where: str) -> str:
  if "####" not in answer:
    raise ValueError(f"{where}: field 'answer' has no '#### <final answer>' marker")
  return answer.split("####")[-1].strip().replace(",", "")


def parse_row(row: Any, fmt: str, where: str, instruction: str = "",
              system_prompt: str = "") -> MathRow:
  if not isinstance(row, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
  if fmt == "auto":
    fmt = "gsm8k" if "question" in row else "dapo" if "prompt" in row else None
    if fmt is None:
      raise ValueError(f"{where}: missing field 'question' (GSM8K) or 'prompt' (DAPO)")
  if fmt == "gsm8k":
    question = _field(row, "question", where)
    answer = gsm8k_answer(str(_field(row, "answer", where)), where)
    text = f"{question}\n{instruction}".strip() if instruction else str(question)
    messages = ({"role": "user", "content": text},)
  elif fmt == "dapo":
    prompt = _field(row, "prompt", where)
    answer = str(_field(row, "reward_model.ground_truth", where))
    if isinstance(prompt, str):
      messages = ({"role": "user", "content": prompt},)
    elif isinstance(prompt, (list, tuple)) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt) and prompt:
      messages = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    else:
      raise ValueError(f"{where}: field 'prompt' must be a string or a list of "
                       f"{{role, content}} messages")
    if instruction:
      last = dict(messages[-1], content=f"{messages[-1]['content']}\n{instruction}")
      messages = messages[:-1] + (last,)
  else:
    raise ValueError(f"parse_row: format must be auto, gsm8k or dapo, got {fmt!r}")
  if system_prompt and messages[0]["role"] != "system":
    messages = ({"role": "system", "content": system_prompt},) + messages
  return MathRow(messages=messages, answer=answer, where=where)


def load_math_dataset(path: str, fmt: str = "auto", instruction: str = "",
                      system_prompt: str = "") -> list[MathRow]:
  """Every row of `path`; a malformed row raises ValueError naming `file:line`."""
  return [parse_row(row, fmt, where, instruction, system_prompt) for where, row in iter_rows(path)]


def render_chat(messages, template: str | None, tokenizer=None) -> str:
  """Render `messages` + an open assistant turn with a jinja2 chat template (`FALLBACK_TEMPLATE`
  when `template` is None). Without jinja2 installed, the fallback format is built directly."""
  ctx = {"messages": [dict(m) for m in messages], "add_generation_prompt": True}
  for name in ("bos_token", "eos_token"):
    try:
      tid = getattr(tokenizer, name.replace("_token", "_id"), None) if tokenizer else None
      ctx[name] = tokenizer.decode([tid], skip_control=False) if tid is not None else ""
    except (IndexError, ValueError):
      ctx[name] = ""
  try:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
  except ImportError:
    if template is not None:
      raise ImportError("render_chat: a chat template needs jinja2 (pip install jinja2)") from None
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"

  def raise_exception(msg):
    raise jinja2.TemplateError(msg)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = raise_exception
  return env.from_string(template or FALLBACK_TEMPLATE).render(**ctx)


class MathDatasetTask(Task):
  """Rows of `cfg.path` in a fresh random order every epoch; validation from `cfg.val_path` or,
  without one, the last `cfg.val_size` rows held out of training."""

  name = "math"

  def __init__(self, cfg: TaskConfig, tokenizer):
    super().__init__(cfg, tokenizer)
    if not cfg.path:
      raise ValueError("TaskConfig.path: a math dataset task needs a JSONL/parquet file")
    rows = load_math_dataset(cfg.path, cfg.format, cfg.instruction, cfg.system_prompt)
    if cfg.val_path:
      self.val_rows = load_math_dataset(cfg.val_path, cfg.format, cfg.instruction,
                                        cfg.system_prompt)
    else:
      n_val = min(cfg.val_size, len(rows) // 2)
      rows, self.val_rows = rows[:len(rows) - n_val], rows[len(rows) - n_val:]
    if not rows:
      raise ValueError(f"TaskConfig.path: {cfg.path} has no training rows")
    self.rows = rows
    self.template = getattr(tokenizer, "chat_template", None) if cfg.chat_template else None
    self._perm: dict[int, np.ndarray] = {}

  def _example(self, row: MathRow) -> Example:
    return Example(prompt=render_chat(row.messages, self.template, self.tokenizer),
                   answer=row.answer, meta={"where": row.where})

  def example(self, index: int) -> Example:
    n = len(self.rows)
    epoch = index // n
    if epoch not in self._perm:
      self._perm = {epoch: np.random.default_rng([self.cfg.seed, epoch]).permutation(n)}
    return self._example(self.rows[int(self._perm[epoch][index % n])])

  def validation(self, n: int) -> list[Example]:
    return [self._example(r) for r in self.val_rows[:n]]

  def encode_prompt(self, example: Example) -> list[int]:
    # a chat template writes its own BOS (when the model has one)
    return self.tokenizer.encode(example.prompt, bos=self.template is None and
                                 getattr(self.tokenizer, "bos_id", None) is not None)

  def score(self, completion: str, example: Example) -> Score:
    correct = math_verify_reward(completion, example.answer, self.cfg.reward_timeout_s) > 0
    bonus = self.cfg.format_reward * float(extract_answer(completion) is not None)
    return Score(reward=float(correct) + bonus, correct=correct)
