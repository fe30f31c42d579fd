"""Answer extraction and verifiers: exact match and a math-verify check run under a timeout.

A verifier returns 1.0 / 0.0 and never raises on a bad answer: unparsable text, a timeout or an
internal error of the checker all count as wrong (so one pathological sample cannot stop a run).
"""

from __future__ import annotations

import math
import re
import threading

_BOXED = "\\boxed"
_ANSWER_LINE = re.compile(r"(?:answer|Answer|ANSWER)\s*[:：]\s*(.+)")
_HASHES = re.compile(r"####\s*(.+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (balanced braces), or None."""
  start = text.rfind(_BOXED)
  if start < 0:
    return None
  i = text.find("{", start)
  if i < 0:
    return None
  depth = 0
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i + 1:j]
  return None


def extract_answer(text: str) -> str | None:
  """The final answer of a completion: last \\boxed{}, else an "Answer: x" line, else "#### x",
  else the last number."""
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed.strip()
  for pattern in (_ANSWER_LINE, _HASHES):
    found = pattern.findall(text)
    if found:
      return found[-1].strip().rstrip(".").strip("$ ")
  nums = _NUMBER.findall(text)
  return nums[-1] if nums else None


def normalize(ans: str) -> str:
  s = ans.strip().strip("$").strip()
  s = s.replace(",", "").replace(" ", "").rstrip(".")
  if s.startswith("\\text{") and s.endswith("}"):
    s = s[6:-1]
  try:
    f = float(s)
    if math.isfinite(f) and f == int(f):
      return str(int(f))
  except ValueError:
    pass
  return s


def exact_answer_reward(completion: str, gold: str) -> float:
  got = extract_answer(completion)
  return float(got is not None and normalize(got) == normalize(gold))


def _math_verify(completion: str, gold: str, timeout: int | None) -> bool:
  from math_verify import parse, verify

  gold_text = gold if "$" in gold or _BOXED in gold else f"${gold}$"
  gold_parsed = parse(gold_text, parsing_timeout=timeout)
  answer = parse(completion, parsing_timeout=timeout)
  if not gold_parsed or not answer:
    return False
  return bool(verify(gold_parsed, answer, timeout_seconds=timeout))


def math_verify_reward(completion: str, gold: str, timeout_s: float = 5.0) -> float:
  """1.0 if math-verify finds the completion's answer equal to `gold`, else 0.0.

  In the main thread math-verify's own SIGALRM timeouts bound each parse/verify; elsewhere the check
  runs in a daemon thread joined with `timeout_s` (a stuck check is abandoned, scored 0). Without
  math-verify installed this falls back to `exact_answer_reward`.
  """
  try:
    import math_verify  # noqa: F401
  except ImportError:
    return exact_answer_reward(completion, gold)
  try:
    if threading.current_thread() is threading.main_thread():
      return float(_math_verify(completion, gold, max(1, math.ceil(timeout_s))))
    box: list[bool] = []

    def run():
      try:
        box.append(_math_verify(completion, gold, None))
      except Exception:  # noqa: BLE001
        box.append(False)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return float(bool(box and box[0]))
  except Exception:  # noqa: BLE001 - checker failures (incl. its TimeoutException) are wrong answers
    return 0.0
