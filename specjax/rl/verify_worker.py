"""A function run in a worker process under a wall-clock timeout, for checks that may hang.

A check stuck in pure computation (sympy expanding 9^(9^(9^9))) cannot be interrupted inside
the process: a thread cannot be killed, and signals work in the main thread only. `TimedWorker`
runs the function in one long-lived child process instead, and when a call times out it kills
that process (nothing is left behind: no thread, no process) and starts a fresh one for the next
call. The child is a plain `python -c` process (no fork of this multithreaded process, and no
re-import of the parent's main module as multiprocessing's spawn does): it imports only this
module and the target's, and talks over its stdin and stdout, one JSON line per call.

The module imports nothing heavy: the child imports it (and `specjax`, `specjax.rl`) at start.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

# the child: the parent's import path, then this module's loop
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
         "from specjax.rl.verify_worker import serve; serve(*sys.argv[2:])")


class CallTimeout(TimeoutError):
  """The call did not return within its timeout; its worker process was killed and replaced."""


class CallFailed(RuntimeError):
  """The function raised in the worker process (the message is its `type: message`)."""


class WorkerDied(CallFailed):
  """The worker process died during the call (killed, out of memory, crashed); it is replaced."""


class WorkerStartError(RuntimeError):
  """The worker process did not start: it could not import or warm up its target, or died or
  hung doing so."""


class TimedWorker:
  """Calls `target` ("module:function", importable in a fresh interpreter) in a worker process:
  `call(*args, timeout=s)` returns its result (JSON) or raises `CallTimeout`, `CallFailed` or
  `WorkerDied`. `warmup`: arguments of a first call the child makes before it reports ready, so
  that imports and first-use set-up are not counted against a call's timeout (the start has its
  own limit, `start_timeout`). One call runs at a time (calls from several threads take turns).
  `close()` ends the process."""

  def __init__(self, target: str, warmup: tuple | None = None, start_timeout: float = 120.0):
    self.target, self.warmup, self.start_timeout = target, warmup, start_timeout
    self._lock = threading.Lock()
    self._proc: subprocess.Popen | None = None
    self._ready = False
    self._buffer = b""
    self.restarts = 0  # processes started after a timeout or a death

  @property
  def pid(self) -> int | None:
    """The worker process's id (None: none running)."""
    return None if self._proc is None else self._proc.pid

  def call(self, *args: Any, timeout: float) -> Any:
    with self._lock:
      if self._proc is not None and self._proc.poll() is not None:
        self._stop()  # died while idle (e.g. a scheduler's signal to the process group)
      if self._proc is None:
        self._start()
      if not self._ready:
        self._await_ready()
      try:
        self._send({"args": list(args)})
        reply = self._receive(time.monotonic() + timeout)
      except TimeoutError:
        self._replace()
        raise CallTimeout(f"{self.target} did not return within {timeout:g} s; its worker "
                          f"process was killed and replaced") from None
      except (EOFError, BrokenPipeError) as e:
        code = self._proc.wait() if self._proc is not None else None
        self._replace()
        raise WorkerDied(f"the worker process of {self.target} died during the call (exit code "
                         f"{code}); it was replaced") from e
      if "error" in reply:
        raise CallFailed(reply["error"])
      return reply["ok"]

  def close(self) -> None:
    """Kill the worker process (if any) and reap it."""
    with self._lock:
      self._stop()

  # -- the process ------------------------------------------------------------------------------
  def _start(self) -> None:
    argv = [sys.executable, "-c", _BOOT, json.dumps(sys.path), self.target,
            json.dumps(self.warmup), str(os.getpid())]
    # stdin and stdout carry the calls; stderr is the parent's, so the child's own warnings and
    # a crash's traceback are seen
    self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  bufsize=0, close_fds=True)
    self._ready, self._buffer = False, b""

  def _await_ready(self) -> None:
    try:
      reply = self._receive(time.monotonic() + self.start_timeout)
    except (TimeoutError, EOFError) as e:
      what = f"did not start within {self.start_timeout:g} s" if isinstance(e, TimeoutError) \
          else "died while starting"
      code = self._proc.poll()
      self._stop()
      raise WorkerStartError(f"the worker process of {self.target} {what} (exit code {code}; "
                             f"its stderr is above)") from None
    if "error" in reply:
      self._stop()
      raise WorkerStartError(f"the worker process of {self.target} could not start: "
                             f"{reply['error']}")
    self._ready = True

  def _replace(self) -> None:
    """Kill the process and start the next one now: it imports while the caller goes on."""
    self._stop()
    self._start()
    self.restarts += 1

  def _stop(self) -> None:
    proc, self._proc, self._ready = self._proc, None, False
    if proc is None:
      return
    if proc.poll() is None:
      proc.kill()
    proc.wait()  # reaped: no zombie
    for pipe in (proc.stdin, proc.stdout):
      pipe.close()

  def _send(self, message: dict) -> None:
    data = memoryview(json.dumps(message).encode() + b"\n")
    fd = self._proc.stdin.fileno()
    while data:  # the child reads while this writes (a long completion fills the pipe)
      data = data[os.write(fd, data):]

  def _receive(self, deadline: float) -> dict:
    """The child's next reply line; TimeoutError past `deadline`, EOFError when it exits."""
    fd = self._proc.stdout.fileno()
    while b"\n" not in self._buffer:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        raise TimeoutError
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        raise EOFError
      self._buffer += chunk
    line, self._buffer = self._buffer.split(b"\n", 1)
    return json.loads(line)


# -- the child ------------------------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
  """Linux: the kernel kills this process when the thread that started it ends (the parent's
  death included, even by SIGKILL), so a check stuck in computation never outlives its caller;
  the next call starts a fresh process."""
  try:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux: the parent kills it at exit
    pass
  if os.getppid() != parent:  # the parent died before prctl
    os._exit(0)


def _describe(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__


def serve(target: str, warmup: str, parent: str) -> None:
  """The child's loop: import `target`, make the warm-up call, report ready, then answer one
  JSON line per call until stdin closes."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the process group is the parent's
  _die_with_parent(int(parent))
  replies = os.fdopen(os.dup(1), "wb", buffering=0)
  os.dup2(2, 1)  # what the target prints goes to stderr, not into the replies

  def reply(**message):
    replies.write(json.dumps(message).encode() + b"\n")

  try:
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    args = json.loads(warmup)
    if args is not None:
      fn(*args)
  except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
    reply(error=_describe(e))
    return
  reply(ready=True)
  for line in sys.stdin.buffer:
    try:
      reply(ok=fn(*json.loads(line)["args"]))
    except Exception as e:  # noqa: BLE001 - the parent raises it as CallFailed
      reply(error=_describe(e))


# -- math-verify -----------------------------------------------------------------------------------

def math_verify_check(completion: str, gold: str, timeout: int | None) -> bool:
  """math-verify's verdict on `completion` against `gold`; `timeout`: math-verify's own (SIGALRM,
  main thread only) limit on each parse and comparison, None for none."""
  from math_verify import parse, verify

  gold_text = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
  gold_parsed = parse(gold_text, parsing_timeout=timeout)
  answer = parse(completion, parsing_timeout=timeout)
  if not gold_parsed or not answer:
    return False
  return bool(verify(gold_parsed, answer, timeout_seconds=timeout))


def untimed_math_verify(completion: str, gold: str) -> bool:
  """`math_verify_check` without math-verify's timeouts, for a worker process (whose caller
  bounds the time by killing it)."""
  # math-verify warns once per process that its own timeouts are off: expected here
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  return math_verify_check(completion, gold, None)
