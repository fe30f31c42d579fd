"""Local math datasets in the GSM8K and DAPO-Math formats, as an RL task.

Sources (read with the `datasets` library, see `hf_datasets.py`): JSON/JSONL or parquet files, a
`save_to_disk` directory, a directory of data files, or a hub cache repository (datasets--*).
GSM8K rows: {"question": str, "answer": "... #### 72"}. DAPO-Math-17k rows: {"prompt": [{"role",
"content"}, ...] (or a string), "reward_model": {"ground_truth": str}}. Prompts go through the
tokenizer's chat template (jinja2); a tokenizer directory without one is an error unless the
template was chosen explicitly ("none": `FALLBACK_TEMPLATE`) or TaskConfig.chat_template is False.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from specjax.errors import UserError
from specjax.rl.config import TaskConfig
from specjax.rl.tasks import Example, Score, Task, epoch_index
from specjax.rl.tasks.hf_datasets import columns, open_dataset
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


def iter_rows(path: str, split: str = "train",
              cache_dir: str | None = None) -> Iterator[tuple[str, Any]]:
  """(where, row) for every row of a dataset file or directory (see `hf_datasets.open_dataset`)."""
  ds, source = open_dataset(path, split, cache_dir)
  for i, row in enumerate(ds, 1):
    yield f"{source}:{i}", row


REQUIRED_COLUMNS = {"gsm8k": ("question", "answer"), "dapo": ("prompt", "reward_model")}


def check_columns(present, fmt: str, source: str) -> None:
  """A clear error, naming the source and the columns it has, when `fmt`'s columns are absent."""
  present = sorted(present)
  if fmt == "auto":
    if "question" not in present and "prompt" not in present:
      raise UserError(f"{source}: missing column 'question' (GSM8K) or 'prompt' (DAPO); "
                      f"columns present: {present}")
    return
  for name in REQUIRED_COLUMNS.get(fmt, ()):
    if name not in present:
      raise UserError(f"{source}: missing column {name!r} ({fmt} format needs "
                      f"{list(REQUIRED_COLUMNS[fmt])}); columns present: {present}")


def _field(row: Any, dotted: str, where: str) -> Any:
  cur = row
  for part in dotted.split("."):
    if not isinstance(cur, dict) or part not in cur or cur[part] is None:
      raise UserError(f"{where}: missing field {dotted!r}")
    cur = cur[part]
  return cur


def _text(value: Any, name: str, where: str) -> str:
  """A text field; numbers are taken as their text (an answer of 72)."""
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise UserError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
  return str(value)


def gsm8k_answer(answer: str, where: str) -> str:
  if "####" not in answer:
    raise UserError(f"{where}: field 'answer' has no '#### <final answer>' marker")
  return answer.split("####")[-1].strip().replace(",", "")


def parse_row(row: Any, fmt: str, where: str, instruction: str = "",
              system_prompt: str = "") -> MathRow:
  if not isinstance(row, dict):
    raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
  if fmt == "auto":  # columnar sources fill a row's absent fields with None
    fmt = "gsm8k" if row.get("question") is not None else \
        "dapo" if row.get("prompt") is not None else None
    if fmt is None:
      raise UserError(f"{where}: missing field 'question' (GSM8K) or 'prompt' (DAPO)")
  if fmt == "gsm8k":
    question = _text(_field(row, "question", where), "question", where)
    answer = gsm8k_answer(_text(_field(row, "answer", where), "answer", where), where)
    text = f"{question}\n{instruction}".strip() if instruction else str(question)
    messages = ({"role": "user", "content": text},)
  elif fmt == "dapo":
    prompt = _field(row, "prompt", where)
    answer = _text(_field(row, "reward_model.ground_truth", where), "reward_model.ground_truth",
                   where)
    if isinstance(prompt, str):
      messages = ({"role": "user", "content": prompt},)
    elif isinstance(prompt, (list, tuple)) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt) and prompt:
      messages = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    else:
      raise UserError(f"{where}: field 'prompt' must be a string or a list of "
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
                      system_prompt: str = "", *, split: str = "train",
                      cache_dir: str | None = None) -> list[MathRow]:
  """Every row of the dataset at `path` (a file or a directory, `split` of a multi-split one);
  missing columns raise UserError naming the source and the columns present, a malformed row
  names `file:row`. `cache_dir`: where `datasets` keeps its Arrow cache (default: its own)."""
  ds, source = open_dataset(path, split, cache_dir)
  if not len(ds):
    raise UserError(f"{source}: the dataset has no rows")
  check_columns(columns(ds), fmt, source)
  return [parse_row(row, fmt, f"{source}:{i}", instruction, system_prompt)
          for i, row in enumerate(ds, 1)]


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


def chat_template_of(tokenizer) -> str | None:
  """The tokenizer's chat template; an HF tokenizer without one (and no explicit choice) raises,
  naming its directory. Tokenizers with no notion of templates (CharTokenizer) give None."""
  require = getattr(tokenizer, "require_chat_template", None)
  return require() if require is not None else getattr(tokenizer, "chat_template", None)


class ChatMathTask(Task):
  """What the math tasks share: prompts rendered with `self.template` (set by the subclass; None:
  no chat template, a BOS added when the tokenizer has one) and answers scored by math-verify,
  plus TaskConfig.format_reward for a findable final answer."""

  template: str | None = None

  def encode_prompt(self, example: Example) -> list[int]:
    # a chat template writes its own BOS (when the model has one)
    return self.tokenizer.encode(example.prompt, bos=self.template is None and
                                 getattr(self.tokenizer, "bos_id", None) is not None)

  def score(self, completion: str, example: Example) -> Score:
    correct = math_verify_reward(completion, example.answer, self.cfg.reward_timeout_s) > 0
    bonus = self.cfg.format_reward * float(extract_answer(completion) is not None)
    return Score(reward=float(correct) + bonus, correct=correct)


class MathDatasetTask(ChatMathTask):
  """Rows of `cfg.path` in a fresh random order every epoch; validation from `cfg.val_path` or,
  without one, the last `cfg.val_size` rows held out of training."""

  name = "math"

  def __init__(self, cfg: TaskConfig, tokenizer):
    super().__init__(cfg, tokenizer)
    if not cfg.path:
      raise UserError("TaskConfig.path: a math dataset task needs a JSONL/parquet file")
    rows = load_math_dataset(cfg.path, cfg.format, cfg.instruction, cfg.system_prompt)
    if cfg.val_path:
      self.val_rows = load_math_dataset(cfg.val_path, cfg.format, cfg.instruction,
                                        cfg.system_prompt)
    else:
      n_val = min(cfg.val_size, len(rows) // 2)
      rows, self.val_rows = rows[:len(rows) - n_val], rows[len(rows) - n_val:]
    if not rows:
      raise UserError(f"TaskConfig.path: {cfg.path} has no training rows")
    self.rows = rows
    self.template = chat_template_of(tokenizer) if cfg.chat_template else None

  def _example(self, row: MathRow) -> Example:
    return Example(prompt=render_chat(row.messages, self.template, self.tokenizer),
                   answer=row.answer, meta={"where": row.where})

  def example(self, index: int) -> Example:
    return self._example(self.rows[epoch_index(index, len(self.rows), (self.cfg.seed,))])

  def validation(self, n: int) -> list[Example]:
    return [self._example(r) for r in self.val_rows[:n]]
