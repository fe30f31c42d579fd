"""The engine's compiled programs: the prefill and the segment (`segment.py`) as jit takes them,
one run's calls of them (`Programs`), compiling many at once, and the process-wide count of the
engine's compiled programs (`PROGRAMS`).

jit hashes its static arguments at every call, so the target's graphdef and the drafter go in
wrapped once per run (`HashedOnce`); a drafter at another draft length or tree width is another
static argument, hence another program.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp

from specjax.sampling.core import SamplingConfig, finish
from specjax.sampling.drafter import Drafter
from specjax.sampling.engine_config import EngineConfig
from specjax.sampling.segment import EngineState, SegmentSpec, init_state, run_segment


class HashedOnce:
  """A static jit argument whose hash is computed once. jit hashes its static arguments at every
  call, and an nnx GraphDef's hash walks the whole graph (about 1 ms at 28 layers), which every
  segment and prefill would pay; equal when the values are (at once when they are the same)."""

  __slots__ = ("value", "hash")

  def __init__(self, value):
    self.value, self.hash = value, hash(value)

  def __hash__(self) -> int:
    return self.hash

  def __eq__(self, other) -> bool:
    return isinstance(other, HashedOnce) and self.hash == other.hash and (
        self.value is other.value or self.value == other.value)


def _unwrapping_statics(fn):
  """`fn(graphdef, params, drafter, ...)` called with a `HashedOnce` graphdef and drafter (or
  None); its signature kept, for jit's argument names."""
  @functools.wraps(fn)
  def call(graphdef, params, drafter, *args, **kwargs):
    return fn(graphdef.value, params, None if drafter is None else drafter.value, *args,
              **kwargs)
  return call


init_jit = jax.jit(_unwrapping_statics(init_state),
                   static_argnames=("graphdef", "drafter", "cfg", "cache_size", "max_draft_len",
                                    "mesh", "group", "target_cache_size"))
# a segment takes its state (donated): its caches are updated in place, so the engine holds its
# KV memory once, not twice, while a segment runs
segment_jit = jax.jit(_unwrapping_statics(run_segment),
                      static_argnames=("graphdef", "drafter", "spec", "mesh"),
                      donate_argnames=("state",))
finish_jit = jax.jit(finish, static_argnames=("cfg",))


class ProgramCount:
  """How many of the engine's programs XLA has compiled, or loaded from the persistent
  compilation cache, in this process since the engine first ran or was first asked, and the
  seconds every program's compile took (`seconds`, the engine's or not; `by_name`: seconds and
  count per program name, as XLA names them). JAX reports every
  compile to process-wide listeners, so there is one count per process (`PROGRAMS`); its
  listener is registered then (`listen`), not when this module is imported."""

  NAMES = frozenset(f"jit({name})" for name in (  # the engine's programs, as XLA names them
      "init_state", "run_segment", "take_rows", "summarize", "write_back", "harvest", "admit",
      "start_paged", "admit_paged", "read_pages_program", "write_pages_program"))

  def __init__(self):
    self.count = 0
    self.seconds = 0.0
    self.by_name: dict[str, list] = {}  # name -> [seconds, count]
    self._listening = False

  def listen(self) -> None:
    if not self._listening:
      self._listening = True
      jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, secs: float, *args, fun_name: str = "", **kwargs) -> None:
    # (the event covers a compile and a load from the persistent cache alike)
    if event == "/jax/core/compile/backend_compile_duration":
      self.seconds += secs
      self.count += fun_name in self.NAMES
      rec = self.by_name.setdefault(fun_name, [0.0, 0])
      rec[0] += secs
      rec[1] += 1


PROGRAMS = ProgramCount()


def compiled_programs() -> int:
  """Programs the engine has compiled (or loaded from the persistent compilation cache) in this
  process: prefills, segments (compiled ahead of their first run, which would take their state),
  compaction's gathers, summaries and write-backs, and the queue's harvests and admissions."""
  PROGRAMS.listen()
  return PROGRAMS.count


def compile_seconds() -> float:
  """Seconds XLA has spent compiling (or loading from the persistent compilation cache) every
  program of this process since this was first asked, or the engine first ran."""
  PROGRAMS.listen()
  return PROGRAMS.seconds


def program_statics(engine: EngineConfig) -> tuple:
  """The engine settings that change a segment's program, hence its step cost: the KV memory's
  layout (dense, or paged with its pool, page size and kernel launch) and the window block."""
  paging = engine.paging
  layout = ("dense",) if paging.kv_cache_gb <= 0 else \
      ("paged", paging.kv_cache_gb, paging.page_size, paging.kernel_pages, paging.kernel_warps,
       paging.kernel_splits)
  return layout + (("window_block", engine.buckets.window_block),)


class Programs:
  """One engine run's calls of its compiled programs: the target and the drafter (at each draft
  length and tree width a segment runs) as jit takes them, made and hashed once per run; the
  prefill; a segment, run or compiled ahead of its first run; and many programs compiled at
  once. K lives in the drafter a segment is given: `drafter.draft_len`."""

  def __init__(self, graphdef, params, drafter: Drafter | None, drafter_params,
               cfg: SamplingConfig, cache_size: int, engine: EngineConfig, mesh):
    PROGRAMS.listen()
    self.graphdef, self.params = graphdef, params
    self.drafter, self.drafter_params = drafter, drafter_params
    self.cfg, self.cache_size, self.engine, self.mesh = cfg, cache_size, engine, mesh
    self.k_max = 0 if drafter is None else drafter.draft_len
    # positions a step writes past a row's last committed token, at most: K, or the drafted
    # nodes of the drafter's tree at K (`Drafter.write_span`); what paged rows take pages for
    self.span_max = 0 if drafter is None else drafter.write_span
    self._graphdef = HashedOnce(graphdef)
    self._drafters: dict[tuple, HashedOnce] = {}  # (draft_len, tree_width) -> hashed drafter

  def drafter_at(self, draft_len: int, tree_width: int | None = None) -> HashedOnce:
    """The drafter at `draft_len` (and `tree_width`; None: its own) as the jitted programs take
    it (a draft model's graphdef is hashed as the target's is)."""
    key = (draft_len, tree_width)
    if key not in self._drafters:
      changes = dict(draft_len=draft_len) if tree_width is None else \
          dict(draft_len=draft_len, tree_width=tree_width)
      self._drafters[key] = HashedOnce(dataclasses.replace(self.drafter, **changes))
    return self._drafters[key]

  def prefill(self, prompts, prompt_lengths, key, group: int) -> EngineState:
    drafter = None if self.drafter is None else self.drafter_at(max(self.k_max, 1))
    # a paged run prefills into a prompt-wide dense buffer, then copies it into pages
    target_size = prompts.shape[1] if self.engine.paging.kv_cache_gb else 0
    return init_jit(self._graphdef, self.params, drafter, self.drafter_params, prompts,
                    prompt_lengths, key, cfg=self.cfg, cache_size=self.cache_size,
                    max_draft_len=max(self.k_max, 1), mesh=self.mesh, group=group,
                    target_cache_size=target_size)

  def _segment_args(self, state, key, k: int, width: int, observe: bool, window: int,
                    max_iters: int, stop_at_live: int, stop_at_paused: int,
                    commit: bool) -> tuple[tuple, dict]:
    # K = 0: one AR program whatever the width; the drafter goes in only to observe the steps
    drafter = self.drafter_at(max(k, 1), width if k > 0 else 1) if k > 0 or observe else None
    spec = SegmentSpec(cfg=self.cfg, drafts=k > 0, window=window)
    return ((self._graphdef, self.params, drafter, self.drafter_params, key, state,
             jnp.int32(max_iters), jnp.int32(stop_at_live)),
            dict(spec=spec, mesh=self.mesh, stop_at_paused=jnp.int32(stop_at_paused),
                 commit=jnp.asarray(commit)))

  def segment(self, state, key, k: int, width: int, observe: bool, window: int, max_iters: int,
              stop_at_live: int, stop_at_paused: int = 1, commit: bool = True):
    """Run a segment at K (a draft tree of `width` at K > 0; `observe`: a stateful drafter
    observes an AR segment's steps). It takes `state` (donated): returns (the state, steps
    run). `commit` False: a dry run, whose returned state is `state` as it was
    (`segment.committed`)."""
    args, kwargs = self._segment_args(state, key, k, width, observe, window, max_iters,
                                      stop_at_live, stop_at_paused, commit)
    return segment_jit(*args, **kwargs)

  def compile_segment(self, state, key, k: int, width: int, observe: bool, window: int) -> None:
    """Compile the segment program of (K, width, window) for `state`'s shapes (its bucket)
    without running it (a run would take the state); its first run then finds it compiled."""
    args, kwargs = self._segment_args(state, key, k, width, observe, window, 0, 0, 1, True)
    segment_jit.lower(*args, **kwargs).compile()

  def compile_all(self, jobs: list) -> float:
    """Run `jobs` (each compiles programs) `EngineConfig.compile.threads` at a time (XLA
    compiles one program on one core): the seconds it took."""
    threads = min(self.engine.compile.threads or min(os.cpu_count() or 1, 4), len(jobs))
    t0 = time.perf_counter()
    if threads > 1:
      with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        jax.block_until_ready(list(pool.map(lambda job: job(), jobs)))
    else:
      jax.block_until_ready([job() for job in jobs])
    return time.perf_counter() - t0

  def finish(self, prompts, prompt_lengths, results, total_steps: int, stats):
    return finish_jit(prompts, prompt_lengths, results.tokens, results.logprobs,
                      results.lengths, self.cfg, jnp.int32(total_steps), stats)
