"""The rollout worker of async RL: a daemon thread that turns published policy versions into
batches for the trainer through a bounded queue, never from params older than the lag allows."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import warnings
from typing import Any, Callable

_POLL_S = 0.5  # how often blocked waits look at the stop flag / the worker's health


class RolloutWorkerError(RuntimeError):
  """The rollout worker failed; the worker's exception is the `__cause__`."""


@dataclasses.dataclass
class RolloutBatch:
  index: int  # the train step this batch is for (batches are produced in index order)
  version: int  # version of the params it was generated with (optimizer steps they had taken)
  payload: Any
  produce_s: float  # worker seconds spent in `produce`
  wait_s: float  # worker seconds spent waiting for a recent enough version


_END = object()  # queue sentinel: the worker has stopped (finished, failed or was told to)

Produce = Callable[[int, int, Any], Any]  # (index, version, params) -> payload


class RolloutWorker:
  """Produces batches `first_index .. first_index + num_batches - 1`, batch i from the newest
  published params whose version is >= i - policy_lag (waiting for a push when none is).

  `produce(index, version, params)` does the work, e.g. jitted generation on the generation mesh
  (JAX releases the GIL while devices compute, so the trainer's thread runs on meanwhile). Use as a
  context manager (or call `close`): `publish` after every optimizer step, `get` per step. An
  exception in the worker is raised by `get` in the trainer's thread as `RolloutWorkerError`.
  """

  def __init__(self, produce: Produce, *, first_index: int, num_batches: int, policy_lag: int,
               queue_size: int, name: str = "rollout-worker"):
    if num_batches < 0 or policy_lag < 0 or queue_size < 1:
      raise ValueError(f"RolloutWorker: need num_batches >= 0, policy_lag >= 0, queue_size >= 1; "
                       f"got {num_batches}, {policy_lag}, {queue_size}")
    self.produce = produce
    self.first_index, self.num_batches = first_index, num_batches
    self.policy_lag = policy_lag
    self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
    self._cond = threading.Condition()
    self._version: int | None = None
    self._params: Any = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=name, daemon=True)
    self.error: BaseException | None = None
    self.failed_index: int | None = None
    self.produced = 0  # batches put on the queue
    self.consumed = 0  # batches handed to the trainer by `get`
    self.discarded = 0  # batches still queued at `close`
    self._ended = False

  # -- trainer side --------------------------------------------------------------------------
  def start(self, version: int, params: Any) -> "RolloutWorker":
    self.publish(version, params)
    self._thread.start()
    return self

  def publish(self, version: int, params: Any) -> None:
    """Make `params` (already on the generation devices) the newest version."""
    with self._cond:
      if self._version is not None and version <= self._version:
        raise ValueError(f"RolloutWorker.publish: versions must increase, got {version} after "
                         f"{self._version}")
      self._version, self._params = version, params
      self._cond.notify_all()

  @property
  def version(self) -> int | None:
    return self._version

  def get(self, timeout: float | None = None) -> RolloutBatch:
    """The next batch (in index order); raises RolloutWorkerError if the worker failed or ended,
    TimeoutError after `timeout` seconds without a batch."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      self._raise_if_failed()
      if self._ended:
        raise RolloutWorkerError(f"rollout worker has stopped after {self.produced} of "
                                 f"{self.num_batches} batches; none left to get")
      try:
        item = self.queue.get(timeout=_POLL_S)
      except queue.Empty:
        if not self._thread.is_alive() and self.queue.empty():
          self._ended = True
        if deadline is not None and time.monotonic() > deadline:
          raise TimeoutError(f"no rollout batch within {timeout} s") from None
        continue
      if item is _END:
        self._ended = True
        continue
      self._raise_if_failed()  # fail fast even when good batches are still queued
      self.consumed += 1
      return item

  def _raise_if_failed(self) -> None:
    if self.error is not None:
      raise RolloutWorkerError(f"rollout worker failed on batch {self.failed_index}: "
                               f"{type(self.error).__name__}: {self.error}") from self.error

  def close(self, timeout: float = 60.0) -> None:
    """Stop the worker, drop what is queued (counted in `discarded`) and join the thread; a
    worker still busy after `timeout` s is left behind (it is a daemon) with a warning."""
    self._stop.set()
    with self._cond:
      self._cond.notify_all()
    deadline = time.monotonic() + timeout
    while self._thread.ident is not None:  # started
      self._drain()
      self._thread.join(timeout=min(_POLL_S, max(deadline - time.monotonic(), 0.0)))
      if not self._thread.is_alive() or time.monotonic() >= deadline:
        break
    self._drain()
    if self._thread.is_alive():
      warnings.warn(f"RolloutWorker.close: the worker thread is still busy after {timeout} s; "
                    f"leaving it (daemon)")
    with self._cond:
      self._params = None

  def _drain(self) -> None:
    while True:
      try:
        item = self.queue.get_nowait()
      except queue.Empty:
        return
      if item is not _END:
        self.discarded += 1

  def __enter__(self) -> "RolloutWorker":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- worker thread -------------------------------------------------------------------------
  def _params_for(self, index: int) -> tuple[int, Any] | None:
    """The newest (version, params) with version >= index - lag; None when told to stop."""
    with self._cond:
      while not self._stop.is_set() and self._version < index - self.policy_lag:
        self._cond.wait(timeout=_POLL_S)
      return None if self._stop.is_set() else (self._version, self._params)

  def _put(self, item: Any) -> bool:
    while not self._stop.is_set():
      try:
        self.queue.put(item, timeout=_POLL_S)
        return True
      except queue.Full:
        continue
    return False

  def _run(self) -> None:
    index = self.first_index
    try:
      for index in range(self.first_index, self.first_index + self.num_batches):
        t0 = time.perf_counter()
        got = self._params_for(index)
        if got is None:
          return
        version, params = got
        t1 = time.perf_counter()
        payload = self.produce(index, version, params)
        del params  # an old version's buffers go as soon as the trainer drops them too
        item = RolloutBatch(index, version, payload, time.perf_counter() - t1, t1 - t0)
        if not self._put(item):
          return
        self.produced += 1
    except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread by `get`
      self.failed_index, self.error = index, e
    finally:
      try:
        self.queue.put_nowait(_END)
      except queue.Full:
        pass  # the trainer finds the queue non-empty, then the dead thread
