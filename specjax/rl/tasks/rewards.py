"""Answer extraction and verifiers: exact match and a math-verify check run under a timeout.

A verifier returns 1.0 / 0.0 and never raises on a bad answer: unparsable text, a timeout or an
internal error of the checker all count as wrong (so one pathological sample cannot stop a run).
Off the main thread math-verify runs in a worker process killed on timeout
(`specjax.rl.verify_worker`).
"""

from __future__ import annotations

import atexit
import math
import re
import threading
import warnings

from specjax.rl.verify_worker import (CallFailed, CallTimeout, TimedWorker, WorkerDied,
                                      math_verify_check)

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


_VERIFIER: TimedWorker | None = None
_VERIFIER_LOCK = threading.Lock()


def _verifier() -> TimedWorker:
  """The process's math-verify worker (started on first use, closed at exit)."""
  global _VERIFIER
  with _VERIFIER_LOCK:
    if _VERIFIER is None:
      _VERIFIER = TimedWorker("specjax.rl.verify_worker:untimed_math_verify", warmup=("$1$", "1"))
      atexit.register(_VERIFIER.close)
    return _VERIFIER


def close_verifier() -> None:
  """End the math-verify worker process (the next check off the main thread starts another)."""
  with _VERIFIER_LOCK:
    if _VERIFIER is not None:
      _VERIFIER.close()


def math_verify_reward(completion: str, gold: str, timeout_s: float = 5.0) -> float:
  """1.0 if math-verify finds the completion's answer equal to `gold`, else 0.0.

  In the main thread math-verify's own SIGALRM timeouts bound each parse and comparison
  (`timeout_s` rounded up to whole seconds). Elsewhere signals cannot interrupt the check: it runs
  in a worker process (`TimedWorker`) that is killed and replaced when the whole check takes
  longer than `timeout_s`, so a stuck check leaves no thread or process behind; it scores 0 (as
  does a process that dies during a check, with a warning). A worker process that cannot start
  raises `WorkerStartError` (every answer would score 0 otherwise). Without math-verify installed
  this falls back to `exact_answer_reward`.
  """
  try:
    import math_verify  # noqa: F401
  except ImportError:
    return exact_answer_reward(completion, gold)
  if threading.current_thread() is not threading.main_thread():
    try:
      return float(bool(_verifier().call(completion, gold, timeout=timeout_s)))
    except WorkerDied as e:  # not the answer's doing, so said: a wrong answer all the same
      warnings.warn(f"math_verify_reward: {e}; the completion scores 0")
      return 0.0
    except (CallTimeout, CallFailed):  # a stuck or failing check: a wrong answer
      return 0.0
  try:
    return float(math_verify_check(completion, gold, max(1, math.ceil(timeout_s))))
  except Exception:  # noqa: BLE001 - checker failures (its TimeoutException too) are wrong answers
    return 0.0
