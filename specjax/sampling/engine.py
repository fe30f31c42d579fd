"""The rollout engine on the host: chains segment programs (`segment.py`) with live-batch
compaction into power-of-two buckets (`buckets.py`), an attention window over the live prefix, and
a draft length chosen per bucket (`adaptive.py`) from measured step costs (`calibration.py`) and
running acceptance rates.

Why: RL completions have long-tailed lengths, so most decode steps run with few live rows; a
verify of K+1 tokens is nearly free only while the live batch is small (weight reads dominate),
and costs K+1 steps once arithmetic dominates. A fixed K and a fixed batch cannot follow that.
Every choice here depends only on timings and on tokens already emitted, so every step is
verified exactly as in the static loop: the output keeps the target's distribution.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax.models.paged import PagedKV
from specjax.sampling import paging
from specjax.sampling.adaptive import DraftLenPolicy, DraftShapePolicy, RefillPolicy
from specjax.sampling.calibration import EngineTuning
from specjax.sampling.core import Rollout, SamplingConfig, finish
from specjax.sampling.buckets import (bucket_sizes, compaction, data_parallel_size,
                                      prompt_group, queue_slots, window_for)
from specjax.sampling.drafter import Drafter
from specjax.sampling.engine_config import EngineConfig, Segment
from specjax.sampling.metrics import AcceptanceCounts
from specjax.sampling.segment import (EngineState, SegmentSpec, init_state, map_rows,
                                      release_pages, run_segment, take_rows, with_page_table)
from specjax.sharding.rules import logical_to_spec

logger = logging.getLogger(__name__)


def params_mesh(params):
  """The mesh the parameters are sharded over, when they are (more than one device)."""
  for leaf in jax.tree.leaves(params):
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and mesh.size > 1:
      return mesh
    if sharding is not None:
      return None
  return None


# -- the engine -----------------------------------------------------------------------------------

class _HashedOnce:
  """A static jit argument whose hash is computed once. jit hashes its static arguments at every
  call, and an nnx GraphDef's hash walks the whole graph (about 1 ms at 28 layers), which every
  segment and prefill would pay; equal when the values are (at once when they are the same)."""

  __slots__ = ("value", "hash")

  def __init__(self, value):
    self.value, self.hash = value, hash(value)

  def __hash__(self) -> int:
    return self.hash

  def __eq__(self, other) -> bool:
    return isinstance(other, _HashedOnce) and self.hash == other.hash and (
        self.value is other.value or self.value == other.value)


def _unwrapping_statics(fn):
  """`fn(graphdef, params, drafter, ...)` called with a `_HashedOnce` graphdef and drafter (or
  None); its signature kept, for jit's argument names."""
  @functools.wraps(fn)
  def call(graphdef, params, drafter, *args, **kwargs):
    return fn(graphdef.value, params, None if drafter is None else drafter.value, *args,
              **kwargs)
  return call


_init_jit = jax.jit(_unwrapping_statics(init_state),
                    static_argnames=("graphdef", "drafter", "cfg", "cache_size", "max_draft_len",
                                     "mesh", "group", "target_cache_size"))
# a segment takes its state (donated): its caches are updated in place, so the engine holds its
# KV memory once, not twice, while a segment runs
_segment_jit = jax.jit(_unwrapping_statics(run_segment),
                       static_argnames=("graphdef", "drafter", "spec", "mesh"),
                       donate_argnames=("state",))
_take_jit = jax.jit(take_rows)
_finish_jit = jax.jit(finish, static_argnames=("cfg",))


@jax.jit
def _summary(state: EngineState):
  live = ~state.done
  counts = state.counts.pooled()
  return (live, jnp.where(live, state.seq.lengths, 0),
          jnp.sum(jnp.where(state.row_ids >= 0, state.lengths, 0)),
          counts.num_drafts, counts.accepted_per_position, state.row_ids, state.slots)


@functools.partial(jax.jit, donate_argnames=("out",))
def _write_back(out: EngineState, state: EngineState) -> EngineState:
  """Rows of a bucket state back into the full-size state at their slots (padding dropped)."""
  idx = jnp.where(state.row_ids >= 0, state.slots, out.done.shape[0])
  return map_rows(lambda o, s: o.at[idx].set(s, mode="drop"), out, state)


def _rows_only(*states: EngineState) -> tuple[EngineState, ...]:
  """The states as compaction's programs take them: a paged state without its page buffers."""
  return tuple(paging.without_buffers(s) for s in states)


def _take(state: EngineState, idx: jax.Array, pad: jax.Array) -> EngineState:
  """Compaction's gather of rows `idx` into a bucket state. A paged state's pool is not copied:
  the bucket state holds the same page buffers, which its first segment takes (the full-size
  state keeps its rows, for the write-back)."""
  return paging.with_buffers(_take_jit(*_rows_only(state), idx, pad), state)


def _written_back(out: EngineState, state: EngineState) -> EngineState:
  """`_write_back` of bucket `state` into the full-size `out` (takes `out`); a paged pool moves
  back with the rows, uncopied."""
  return paging.with_buffers(_write_back(*_rows_only(out, state)), state)


@struct.dataclass
class Results:
  """What the engine keeps of each of the caller's rows once it is done (the slots move on)."""

  tokens: jax.Array  # int32[B, N + Kmax + 1]
  logprobs: jax.Array  # float32[B, N + Kmax + 1]
  lengths: jax.Array  # int32[B]
  counts: AcceptanceCounts  # per row


@functools.partial(jax.jit, donate_argnames=("results", "state"))
def _harvest(results: Results, state: EngineState) -> tuple[Results, EngineState]:
  """Finished rows of a full-size state into the caller's rows of `results`; their slots are
  then free (row id -1)."""
  take = state.done & (state.row_ids >= 0)
  idx = jnp.where(take, state.row_ids, results.lengths.shape[0])
  mine = Results(tokens=state.tokens, logprobs=state.logprobs, lengths=state.lengths,
                 counts=state.counts)
  results = jax.tree.map(lambda r, x: r.at[idx].set(x, mode="drop"), results, mine)
  return results, release_pages(state.replace(row_ids=jnp.where(take, -1, state.row_ids)), take)


@jax.jit
def _admission_inputs(prompts, prompt_lengths, key, rows, n):
  """The prompts and lengths of the caller's `rows` and the key of the queue's `n`-th prefill, in
  one dispatch (indexing and folding op by op cost a millisecond or more per refill)."""
  return prompts[rows], prompt_lengths[rows], jax.random.fold_in(key, n)


@functools.partial(jax.jit, donate_argnames=("state",))
def _admit(state: EngineState, new: EngineState, slots: jax.Array,
           row_ids: jax.Array) -> EngineState:
  """Prefilled rows `new` into the free `slots` of a full-size state as the caller's `row_ids`
  (-1: a padding row past the end of the queue, dropped)."""
  idx = jnp.where(row_ids >= 0, slots, state.done.shape[0])
  new = new.replace(row_ids=row_ids, slots=slots)
  return jax.tree.map(lambda o, s: o.at[idx].set(s, mode="drop"), state, new)


class ProgramCount:
  """How many of the engine's programs XLA has compiled, or loaded from the persistent
  compilation cache, in this process since the engine first ran or was first asked. JAX reports
  every compile to process-wide listeners, so there is one count per process (`PROGRAMS`); its
  listener is registered then (`listen`), not when this module is imported."""

  NAMES = frozenset(f"jit({name})" for name in (  # the engine's programs, as XLA names them
      "init_state", "run_segment", "take_rows", "_summary", "_write_back", "_harvest", "_admit",
      "start_paged", "admit_paged", "_read_pages", "_write_pages"))

  def __init__(self):
    self.count = 0
    self._listening = False

  def listen(self) -> None:
    if not self._listening:
      self._listening = True
      jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, *args, fun_name: str = "", **kwargs) -> None:
    # (the event covers a compile and a load from the persistent cache alike)
    if event == "/jax/core/compile/backend_compile_duration" and fun_name in self.NAMES:
      self.count += 1


PROGRAMS = ProgramCount()


def compiled_programs() -> int:
  """Programs the engine has compiled (or loaded from the persistent compilation cache) in this
  process: prefills, segments (compiled ahead of their first run, which would take their state),
  compaction's gathers, summaries and write-backs, and the queue's harvests and admissions."""
  PROGRAMS.listen()
  return PROGRAMS.count


def program_statics(engine: EngineConfig) -> tuple:
  """The engine settings that change a segment's program, hence its step cost: the KV memory's
  layout (dense, or paged with its pool, page size and kernel launch) and the window block."""
  layout = ("dense",) if engine.kv_cache_gb <= 0 else \
      ("paged", engine.kv_cache_gb, engine.page_size, engine.kernel_pages, engine.kernel_warps)
  return layout + (("window_block", engine.window_block),)


class _Run:
  """One call of the engine: the host loop over segments. `drafter.draft_len` is the largest K
  (resolved by `speculative_generate`); with `engine.adaptive` K is chosen per segment among
  `EngineConfig.k_choices` of it."""

  def __init__(self, graphdef, params, drafter, drafter_params, cfg: SamplingConfig,
               cache_size: int, engine: EngineConfig, mesh, tuning: EngineTuning):
    PROGRAMS.listen()
    self.graphdef, self.params = graphdef, params
    self.jit_graphdef = _HashedOnce(graphdef)  # what the jitted programs take
    self._jit_drafters = {}  # (draft_len, tree_width) -> the drafter they take, hashed once
    self.drafter, self.drafter_params = drafter, drafter_params
    self.cfg, self.cache_size, self.engine, self.mesh = cfg, cache_size, engine, mesh
    self.costs = tuning.costs
    if drafter is None:
      self.k_max, k_choices = 0, (0,)
    else:
      self.k_max = drafter.draft_len
      k_choices = engine.k_choices(self.k_max) if engine.adaptive else (self.k_max,)
    # the tree widths a segment may verify: the drafter's; adaptive, also the plain chain (1)
    tree = 1 if drafter is None else drafter.tree_width
    self.widths = (1, tree) if engine.adaptive and tree > 1 else (tree,)
    policies = {}
    for w in self.widths:  # one acceptance estimate per width: a tree accepts more
      key = (None if drafter is None else
             dataclasses.replace(drafter, draft_len=max(self.k_max, 1), tree_width=w),
             cfg, graphdef)
      estimate = tuning.estimates.get(key, max(self.k_max, 1), engine)
      estimate.decay(engine.estimate_decay)
      policies[w] = DraftLenPolicy(k_choices, estimate, engine)
    self.policy = DraftShapePolicy(policies, engine)
    self.adaptive = self.policy.adaptive  # K (and the tree width) is chosen per segment
    # the K each bucket compiles and times when it is prepared; another K costs the line
    # through 0 and k_max until a segment runs it
    self.timed_ks = k_choices[:1] if not self.adaptive else k_choices \
        if engine.calibrate_every_k else tuple(k for k in k_choices if k in (0, self.k_max))
    self.segments: list[Segment] = []
    self.program_id = self.costs.program_id((graphdef, drafter, cfg, cache_size, mesh,
                                             program_statics(engine)))

  def span(self, k: int, width: int = 1) -> int:
    """Cache positions a step at K writes past a row's last committed token (a draft tree of
    `width`: its drafted nodes, `Drafter.write_span`)."""
    if k == 0 or width == 1:
      return k
    return dataclasses.replace(self.drafter, draft_len=k, tree_width=width).write_span

  def _segment_args(self, state, key, k: int, window: int, max_iters: int, stop_at_live: int,
                    stop_at_paused: int, commit: bool = True,
                    width: int = 1) -> tuple[tuple, dict]:
    observe = k > 0 or (self.drafter is not None and self.drafter.stateful and
                        not self.policy.retired)
    # (K = 0: one AR program whatever the width)
    drafter = self.jit_drafter(max(k, 1), width if k > 0 else 1) if observe else None
    spec = SegmentSpec(cfg=self.cfg, draft_len=k, window=window)
    return ((self.jit_graphdef, self.params, drafter, self.drafter_params, key, state,
             jnp.int32(max_iters), jnp.int32(stop_at_live)),
            dict(spec=spec, mesh=self.mesh, stop_at_paused=jnp.int32(stop_at_paused),
                 commit=jnp.asarray(commit)))

  def jit_drafter(self, draft_len: int, tree_width: int | None = None) -> _HashedOnce:
    """The drafter at `draft_len` (and `tree_width`; None: its own) as the jitted programs take
    it, made and hashed once per run (a draft model's graphdef is hashed as the target's is)."""
    key = (draft_len, tree_width)
    if key not in self._jit_drafters:
      changes = dict(draft_len=draft_len) if tree_width is None else \
          dict(draft_len=draft_len, tree_width=tree_width)
      self._jit_drafters[key] = _HashedOnce(dataclasses.replace(self.drafter, **changes))
    return self._jit_drafters[key]

  def segment(self, state, key, bucket: int, k: int, window: int, max_iters: int,
              stop_at_live: int, stop_at_paused: int = 1, commit: bool = True, width: int = 1):
    """Run a segment (a draft tree of `width` at K > 0); it takes `state` (donated: use the
    returned one). `commit` False: a dry run, whose returned state is `state` as it was
    (`segment.committed`)."""
    args, kwargs = self._segment_args(state, key, k, window, max_iters, stop_at_live,
                                      stop_at_paused, commit, width)
    return _segment_jit(*args, **kwargs)

  def compile_segment(self, state, k: int, window: int, width: int = 1) -> None:
    """Compile the segment program of (K, window, width) for `state`'s shapes (its bucket)
    without running it (a run would take the state); its first run then finds it compiled."""
    args, kwargs = self._segment_args(state, self.probe_key, k, window, 0, 0, 1, width=width)
    _segment_jit.lower(*args, **kwargs).compile()

  def cost_key(self, bucket: int, k: int, width: int = 1) -> tuple:
    """(program, bucket, K) of a step cost; a tree's programs are another program than the
    chain's at the same K (K = 0: one program whatever the width)."""
    if width == 1 or k == 0:
      return (self.program_id, bucket, k)
    return (self.costs.program_id((self.program_id, "tree", width)), bucket, k)

  def line_point(self, bucket: int, k: int, width: int = 1) -> tuple:
    """(key of K = 0, key of k_max, fraction): where K lies on the line of `CostTable.line`."""
    return (self.cost_key(bucket, 0), self.cost_key(bucket, self.k_max, width), k / self.k_max)

  def cost(self, box: list, bucket: int, k: int, longest: int, width: int = 1) -> float:
    """Seconds per step at (bucket, K, tree width): for a timed K, measured on the current state
    (`box[0]`, which dry runs take and give back: read it again after the call) the first time
    it is asked for; for another, its own cost once a segment ran it, else the line through the
    bucket's timed K = 0 and k_max (of that width)."""
    if k not in self.timed_ks:
      for end in (0, self.k_max):
        self.cost(box, bucket, end, longest, width)
      key = self.cost_key(bucket, k, width)
      line = self.costs.line(key, *self.line_point(bucket, k, width))
      # no segment ran this K yet: its cost is a guess and choosing it compiles a program, so it
      # must beat the timed K by min_gain
      return line if self.costs.has(key) else line * (1.0 + self.engine.min_gain)
    window = window_for(longest, self.span(k, width), self.engine.window_block, self.cache_size)

    def run(m: int) -> tuple[int, float]:
      # a dry run: it steps the state in its own buffers and gives it back as it was, so every
      # run starts where the rollout is, the rollout is left as it was, and no copy of the
      # state (its KV memory) is made
      jax.block_until_ready(box[0])
      t0 = time.perf_counter()
      box[0], iters = self.segment(box[0], self.probe_key, bucket, k, window, m, 0,
                                   commit=False, width=width)
      iters = int(iters)  # (waits for the segment)
      return iters, time.perf_counter() - t0

    # (a program compiled ahead has not run yet: the first, untimed run finds it compiled)
    return self.costs.step_cost(self.cost_key(bucket, k, width), run,
                                self.engine.calibration_iters, self.engine.calibration_repeats)

  def prepare_buckets(self, state, buckets: list[int], queue_jobs: tuple = ()) -> EngineState:
    """Compile the programs of `buckets` (the first is `state`'s own bucket; the others' states
    are its first rows) on throwaway runs: each bucket's segment at every timed K (`timed_ks`;
    ahead: at every K),
    and for the smaller buckets compaction's gather, summary and write-back. The programs compile
    `compile_threads` at a time (XLA compiles one program on one core); then (adaptive) each
    smaller bucket's timed K are calibrated, one at a time (the first bucket's are timed when the
    policy first asks for them). Programs already compiled, and costs already measured, are
    reused; `queue_jobs` compile the queue's admission programs alongside. Returns `state`
    (a paged state's page buffers are the same ones, passed through the dry runs).

    `EngineConfig.compile_ahead` (True) prepares every bucket at every K before the first
    segment, so a later rollout compiles nothing whichever buckets and K it runs; the default
    prepares a
    bucket when a rollout first reaches it, so the first rollout compiles only what it runs."""
    if not self.costs.first_preparation((self.program_id, self.engine, tuple(buckets),
                                         len(queue_jobs))):
      return state
    prompt_len = int(jax.device_get(jnp.max(state.seq.lengths)))
    # ahead: every K a segment may choose (those between the timed ones would compile in a later
    # step); else the timed K only
    ks = self.policy.k_choices if self.engine.compile_ahead else self.timed_ks
    # what compaction to bucket b runs: gather from the full batch, summary, write-back
    # (a paged state's buckets share its page buffers: the pool is held once)
    subs = {buckets[0]: state}
    for b in buckets[1:]:
      subs[b] = _take(state, jnp.arange(b, dtype=jnp.int32), jnp.zeros((b,), bool))
    # (the write-back takes the full-size state it writes into: compiled, not run)
    jobs = [lambda s=subs[b]: (_summary(s), _write_back.lower(*_rows_only(state, s)).compile())
            for b in buckets[1:]]
    jobs += list(queue_jobs)
    for b in buckets:
      for k, width in self.shapes(ks):
        window = window_for(prompt_len, self.span(k, width), self.engine.window_block,
                            self.cache_size)
        jobs.append(lambda b=b, k=k, w=window, width=width:
                    self.compile_segment(subs[b], k, w, width))
    threads = min(self.engine.compile_threads or min(os.cpu_count() or 1, 4), len(jobs))
    t0 = time.perf_counter()
    if threads > 1:
      with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        jax.block_until_ready(list(pool.map(lambda job: job(), jobs)))
    else:
      jax.block_until_ready([job() for job in jobs])
    compiled = time.perf_counter() - t0
    if self.adaptive:  # (the first bucket's are timed when the policy first asks for them)
      for b in buckets[1:]:
        # (a dry run takes its state's page buffers and gives them back: they go on to the
        # next bucket and back to `state`)
        box = [paging.with_buffers(subs[b], state)]
        for k, width in self.shapes(self.timed_ks):
          self.cost(box, b, k, prompt_len, width)
        state = paging.with_buffers(state, box[0])
    # (progress for a user waiting on a first rollout: compiled programs found in a cache are
    # counted too)
    timed = time.perf_counter() - t0 - compiled
    contiguous = list(ks) == list(range(min(ks), max(ks) + 1))
    k_range = f"{min(ks)}-{max(ks)}" if len(ks) > 1 and contiguous else "/".join(map(str, ks))
    logger.info(f"[engine] buckets {'/'.join(map(str, buckets))} at K {k_range}: "
                f"{len(jobs)} program{'s' * (len(jobs) != 1)} compiled in {compiled:.1f} s" +
                (f", step costs measured in {timed:.1f} s" if timed >= 0.05 else ""))
    return state

  def shapes(self, ks) -> list[tuple[int, int]]:
    """(K, width) of every program the K in `ks` need: K = 0 once, each K > 0 at every width."""
    return [(k, w) for k in ks for w in (self.widths[:1] if k == 0 else self.widths)]

  def prefill(self, prompts, prompt_lengths, key, group: int) -> EngineState:
    drafter = None if self.drafter is None else self.jit_drafter(max(self.k_max, 1))
    # a paged run prefills into a prompt-wide dense buffer, then copies it into pages
    target_size = prompts.shape[1] if self.engine.kv_cache_gb else 0
    return _init_jit(self.jit_graphdef, self.params, drafter, self.drafter_params, prompts,
                     prompt_lengths, key, cfg=self.cfg, cache_size=self.cache_size,
                     max_draft_len=max(self.k_max, 1), mesh=self.mesh, group=group,
                     target_cache_size=target_size)

  def page_pool(self, slots: int = 1, replicas: int = 1) -> paging.SlotPages:
    """An empty pool for the target's KV, and a paged drafter cache's (host-side accounting):
    `EngineConfig.kv_cache_gb` of it on each device, so on a mesh each data-parallel replica
    holds that many GiB of pages times the devices its kv heads split over. A page is a target
    page and, for a drafter whose cache is paged (`Drafter.page_layout`), a drafter page."""
    cfg = nnx.merge(self.graphdef, self.params).cfg
    page_size = self.engine.page_size
    layouts = [(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype)]
    if self.pages_drafter():
      layouts.append(self.drafter.page_layout(self.drafter_params))
    page_bytes = sum(paging.bytes_per_page(layers, hkv, dh, page_size, dtype)
                     / self.kv_head_split(hkv) for layers, hkv, dh, dtype in layouts)
    num_pages = paging.pool_size(self.engine.kv_cache_gb, page_bytes, page_size,
                                 self.cache_size)
    return paging.SlotPages(num_pages, page_size, self.cache_size, self.engine.page_ahead,
                            slots, replicas)

  def kv_head_split(self, num_kv_heads: int) -> int:
    """Devices a page's `num_kv_heads` split over (1 off a mesh)."""
    if self.mesh is None:
      return 1
    spec = logical_to_spec(("kv_heads",), shape=(num_kv_heads,), mesh=self.mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return math.prod(self.mesh.shape[a] for a in axes)

  def pages_drafter(self) -> bool:
    """A paged run keeps the drafter's KV cache on pages too (`Drafter.page_layout`)."""
    return self.drafter is not None and \
        self.drafter.page_layout(self.drafter_params) is not None

  def shared_prefix(self, prompt_len: int, group: int) -> int:
    """Positions whose pages a GRPO group's samples share: the prompt's, less its last one when
    a paged drafter writes there a value of each sample's own (EAGLE-3 pairs the prompt's last
    state with the sample's first token); 0 without groups."""
    if group <= 1:
      return 0
    return prompt_len - 1 if self.pages_drafter() else prompt_len

  def first_admission(self, pages: paging.SlotPages, prompt_lengths: np.ndarray,
                      group: int) -> np.ndarray:
    """Whole prompt groups of the first `len(prompt_lengths)` rows (row i in slot i) take pages
    in order while their replica has them: which rows did."""
    admitted = np.zeros(len(prompt_lengths), bool)
    full = set()  # replicas out of pages
    for first in range(0, len(prompt_lengths) - group + 1, group):
      rows = np.arange(first, first + group)
      if pages.replica_of(first) in full:
        continue
      if not pages.admit(rows, prompt_lengths[rows] + 1, self.k_max,
                         self.shared_prefix(int(prompt_lengths[first]), group)):
        full.add(pages.replica_of(first))
        continue
      admitted[rows] = True
    return admitted

  def start_pages(self, state: EngineState, prompt_lengths: np.ndarray, group: int):
    """The pool for a paged run and its first rows: whole prompt groups take pages in order
    while the pool has them. Returns (state, pages, rows that found none: back to the queue)."""
    dense = state.cache
    _, hkv, dh, _ = dense.k[0].shape
    slots = state.done.shape[0]
    pages = self.page_pool(slots, data_parallel_size(self.mesh))
    admitted = self.first_admission(pages, prompt_lengths[:slots], group)
    launch = dict(kernel_pages=self.engine.kernel_pages, kernel_warps=self.engine.kernel_warps)
    pool = PagedKV.create(len(dense.k), pages.num_pages, pages.page_size, slots,
                          pages.max_pages, hkv, dh, dense.k[0].dtype, mesh=self.mesh, **launch)
    draft_pool = None
    if self.pages_drafter():
      draft = paging.drafter_cache(state.drafter_state)  # (dense, prompt-wide: the prefill's)
      _, d_hkv, d_dh, _ = draft.k[0].shape
      draft_pool = PagedKV.create(len(draft.k), pages.num_pages, pages.page_size, slots,
                                  pages.max_pages, d_hkv, d_dh, draft.k[0].dtype, mesh=self.mesh,
                                  **launch)
    table = pages.table(np.arange(slots), np.where(admitted, 0, -1))
    state = paging.start_paged(state, pool, jnp.asarray(table), jnp.asarray(admitted),
                               draft_pool)
    return state, pages, np.flatnonzero(~admitted)

  def run(self, prompts, prompt_lengths, key) -> Rollout:
    batch = prompts.shape[0]
    dp = data_parallel_size(self.mesh)
    paged = self.engine.kv_cache_gb > 0
    group = prompt_group(prompts, prompt_lengths, dp) if self.engine.share_prefill else 1
    # a queue: `slots` rows step at once; a segment returns once `refill` slots are free, and
    # they take waiting rows, prefilled `prefill_rows` (whole prompt groups) at a time
    queue_ok = self.drafter is None or self.drafter.row_local
    max_rows = self.engine.max_rows if queue_ok else 0
    host_lengths = np.asarray(jax.device_get(prompt_lengths)) if paged else None
    if paged and queue_ok and not max_rows:
      # a memory budget instead of a batch size: as many slots as rows the empty pool holds at
      # once (a slot beyond them could only hold a row without pages, which does not step); on
      # a mesh, what one replica's pages hold of the first rows, on every replica
      holds = self.first_admission(self.page_pool(len(host_lengths)), host_lengths, group)
      max_rows = max(int(holds.sum()), 1) * dp
    slots, refill, prefill_rows = queue_slots(batch, max_rows, group, dp,
                                              self.engine.refill_fraction)
    refills = RefillPolicy(slots, dp, refill)
    compact = self.engine.compaction and queue_ok
    buckets = bucket_sizes(slots, dp, self.engine.min_bucket, self.engine.max_buckets) \
        if compact else bucket_sizes(slots, dp, slots)
    key_prefill, key_loop = jax.random.split(key)
    # calibration and bucket preparation run segments with a key of the caller's kind (a typed
    # key or raw uint32[2]: they are different programs), so they compile what the run uses
    self.probe_key = jax.random.fold_in(key_loop, 2**31 - 1)
    state = self.prefill(prompts[:slots], prompt_lengths[:slots], key_prefill, group)
    width = state.tokens.shape[1]
    results = Results(tokens=jnp.zeros((batch, width), jnp.int32),
                      logprobs=jnp.zeros((batch, width), jnp.float32),
                      lengths=jnp.zeros((batch,), jnp.int32),
                      counts=AcceptanceCounts.zeros(state.counts.draft_len, batch))
    rows = np.arange(slots, batch)  # the caller's rows still waiting (not prefilled), in order
    pages = None
    if paged:
      state, pages, unplaced = self.start_pages(state, host_lengths, group)
      rows = np.concatenate([unplaced, rows]).astype(np.int64)
    queue = _Queue(self, rows, prompts, prompt_lengths, key_prefill, group, prefill_rows, refill,
                   pages, host_lengths)
    waiting, admit = queue.waiting, queue.admit
    swaps_before = 0

    queue_jobs = ()
    if waiting():  # the admission programs compile with the others (compiled, not run: a
      # harvest and an admission take the state they update)
      probe_rows = jnp.arange(prefill_rows, dtype=jnp.int32)

      def compile_admission():
        new = self.prefill(prompts[:prefill_rows], prompt_lengths[:prefill_rows], key_prefill,
                           group)
        if paged:
          table = jnp.full((prefill_rows, pages.max_pages), -1, jnp.int32)
          return paging.admit_paged.lower(state, new, probe_rows, probe_rows, table).compile()
        return _admit.lower(state, new, probe_rows, probe_rows).compile()

      queue_jobs = (lambda: _harvest.lower(results, state).compile(), compile_admission)
    if paged:  # swapping's page copies
      queue_jobs += (lambda: pages.compile_swaps(paging.pools(state)),)
    state = self.prepare_buckets(state, buckets if self.engine.compile_ahead else buckets[:1],
                                 queue_jobs)
    if waiting() and self.engine.refill_from_costs:
      state, refills.costs = self.refill_costs(state, prompts, prompt_lengths, key_prefill, group,
                                               prefill_rows, pages)
    out, bucket, total_steps = state, slots, 0
    per_bucket = {}  # bucket -> segments run there (grows the iteration budget)
    last_k = {}
    # one host round trip per segment: the summary after a segment is the next one's "before"
    summary = jax.device_get(_summary(state))
    while True:
      live_mask, seq_lengths, tokens_before, drafts0, acc0, row_ids, homes = summary
      live = int(live_mask.sum())
      if paged:  # pages: finished rows give theirs back, live rows take more, swaps
        state = self.visit_pages(state, pages, summary)
      no_pages = False  # waiting rows found free slots but no pages
      queue.refill = refill
      while waiting() and slots - live >= refill:  # admit waiting rows into free slots
        results, state = _harvest(results, state)
        # one read of the free slots per refill, not per admission
        free = np.flatnonzero(np.asarray(jax.device_get(state.row_ids)) < 0)
        admitted = False
        while waiting() and len(free) >= refill:
          new_state = admit(state, free)
          if new_state is None:  # no pages: wait for rows to finish
            no_pages = True
            break
          (state, taken), admitted = new_state, True
          free, live = free[~np.isin(free, taken)], live + len(taken)
        out = state
        # (an admitted row can be done at once: its first token ended it)
        summary = jax.device_get(_summary(state))
        live_mask, seq_lengths, tokens_before, drafts0, acc0, _, homes = summary
        live = int(live_mask.sum())
        if not admitted:
          break
      if live == 0:
        if not waiting():
          break
        # every row is done: the pages of rows that ended at their first token come back at
        # the next visit; with every page free, a prompt group must fit
        if not paged or pages.pages_in_use == 0:
          raise ValueError(
              f"EngineConfig.kv_cache_gb={self.engine.kv_cache_gb}: the pool's "
              f"{pages.num_pages // dp} pages{' per data-parallel replica' if dp > 1 else ''} "
              f"cannot hold the first pages of one prompt group ({group} rows); raise "
              f"kv_cache_gb or lower page_ahead")
        continue
      # (paged KV on a mesh: a row's pages lie on its replica, so it stays there)
      new, idx, pad = compaction(homes[np.flatnonzero(live_mask)], buckets, slots, dp,
                                 by_replica=paged)
      if compact and not waiting() and new < bucket:
        # gather the live rows into the smallest bucket, from the full-size state (brought up
        # to date first): one gather program per bucket, whichever bucket the rows come from
        # (a full-size state is its own write-back; `out` then is an earlier state, whose
        # buffers the segments since took)
        out = state if bucket == slots else _written_back(out, state)
        state, bucket = _take(out, jnp.asarray(idx), jnp.asarray(pad)), new
        if not self.engine.compile_ahead:  # (a no-op once the bucket is prepared)
          state = self.prepare_buckets(state, [new])
        # token and acceptance counts now cover only the rows in the bucket
        summary = jax.device_get(_summary(state))
        live_mask, seq_lengths, tokens_before, drafts0, acc0, _, homes = summary
      longest = int(seq_lengths.max())
      box = [state]  # (calibration's dry runs take the state and give it back)
      k, tw, expected = self.policy.choose(
          lambda k, w: self.cost(box, bucket, k, longest, w), live)
      window = window_for(longest, self.span(k, tw), self.engine.window_block, self.cache_size)
      j = per_bucket.get(bucket, 0) if last_k.get(bucket) in (None, (k, tw)) else 0
      per_bucket[bucket], last_k[bucket] = j + 1, (k, tw)
      max_iters = self.policy.budget(k, tw, j)
      if k not in self.timed_ks and not self.costs.has(self.cost_key(bucket, k, tw)):
        # its first segment: compile it first, so the timing below holds only steps
        self.compile_segment(box[0], k, window, tw)
        self.cost(box, bucket, k, longest, tw)  # (the line's ends are timed, if not yet)
        self.costs.start_from_line(self.cost_key(bucket, k, tw),
                                   *self.line_point(bucket, k, tw))
      refilling = waiting() > 0 and bucket == slots
      if refilling and refills.costs is not None:  # (K's step cost is measured by now)
        refill = refills.threshold(self.cost(box, bucket, k, longest, tw),
                                   self.costs.fixed_cost(self.cost_key(bucket, k, tw)))
      state = box[0]
      if bucket == slots:  # (`out` held the state the dry runs took)
        out = state
      if waiting():  # return once `refill` slots are free (or pages: once a row ends)
        stop_at_live = live - 1 if no_pages else slots - refill
      else:
        smaller = [b for b in buckets if b < bucket]
        # (on a mesh, paged: the live rows may fit a smaller bucket, but not each replica's)
        stop_at_live = min(smaller[0], live - 1) if compact and smaller else 0
      t0 = time.perf_counter()
      # (paged) a segment also returns once a refill's worth more rows wait for pages
      paused_rows = pages.paused if paged else 0
      paused = paused_rows + max(refill if waiting() else live // 8, 1)
      state, iters = self.segment(state, jax.random.fold_in(key_loop, len(self.segments)),
                                  bucket, k, window, max_iters, stop_at_live, paused, width=tw)
      if bucket == slots:  # (the segment took the state `out` held)
        out = state
      summary = jax.device_get(_summary(state))
      tokens_after, drafts1, acc1 = summary[2:5]
      seconds = time.perf_counter() - t0
      iters = int(iters)
      total_steps += iters
      if refilling:  # (rows ended in this segment: no row joins during one)
        refills.observe(live - int(summary[0].sum()), iters)
      if k > 0:
        self.policy.estimate(tw).add(k, float(drafts1 - drafts0),
                                 np.asarray(acc1 - acc0, np.float64))
      if self.adaptive and not self.policy.retired:  # the costs of the drafter's programs
        cost_key = self.cost_key(bucket, k, tw)
        self.costs.refine(cost_key, iters, seconds, self.engine.cost_memory)
        self.costs.check_cached(cost_key, iters, seconds, self.engine.recheck_cached_costs,
                                self.engine.recheck_steps)
      self.segments.append(Segment(bucket=bucket, draft_len=k, tree_width=tw, window=window,
                                   live_rows_start=live, iterations=iters,
                                   tokens=int(tokens_after - tokens_before), seconds=seconds,
                                   expected_tokens_per_s=expected,
                                   drafter_retired=self.policy.retired,
                                   pages_in_use=pages.pages_in_use if paged else 0,
                                   swapped_out=pages.swaps - swaps_before if paged else 0,
                                   waiting_for_pages=paused_rows,
                                   refill_at=refill if waiting() else 0))
      swaps_before = pages.swaps if paged else 0
    out = state if bucket == slots else _written_back(out, state)
    results, _ = _harvest(results, out)
    stats = None
    if self.drafter is not None:
      stats = results.counts if self.k_max >= 1 else AcceptanceCounts.zeros(1, batch)
    rollout = _finish_jit(prompts, prompt_lengths, results.tokens, results.logprobs,
                          results.lengths, self.cfg, jnp.int32(total_steps), stats)
    return rollout.replace(segments=tuple(self.segments))

  def refill_costs(self, state: EngineState, prompts, prompt_lengths, key, group: int,
                   prefill_rows: int, pages: paging.SlotPages | None):
    """(state, (fixed seconds per refill, prefill seconds per row)) of this queue, measured as a
    step cost is (`CostTable.step_cost`, kept under K = -1): a timed run of m prefills of
    `prefill_rows` rows, an admission of none of them (every row id -1: the state is left as it
    was) and the summary's round trip; the slope over m is a prefill's cost, the rest the
    refill's fixed cost. (A refill's harvest, a scatter like the admission, is not timed.)"""
    key_cost = (self.costs.program_id(("refill", self.graphdef, self.drafter, self.cfg,
                                       self.cache_size, self.mesh, state.done.shape[0],
                                       pages is not None)), prefill_rows, -1)
    box = [state]
    slots = jnp.arange(prefill_rows, dtype=jnp.int32)
    none = jnp.full((prefill_rows,), -1, jnp.int32)
    table = None if pages is None else jnp.full((prefill_rows, pages.max_pages), -1, jnp.int32)

    def run(m: int) -> int:
      for _ in range(m):
        new = self.prefill(prompts[:prefill_rows], prompt_lengths[:prefill_rows], key, group)
      box[0] = _admit(box[0], new, slots, none) if pages is None else \
          paging.admit_paged(box[0], new, slots, none, table)
      jax.device_get(_summary(box[0]))
      return m

    per_prefill = self.costs.step_cost(key_cost, run, 1, self.engine.calibration_repeats)
    return box[0], (self.costs.fixed_cost(key_cost), per_prefill / prefill_rows)

  def visit_pages(self, state: EngineState, pages: paging.SlotPages, summary) -> EngineState:
    """`SlotPages.visit` between segments, then the state's page table brought up to date."""
    live_mask, seq_lengths, _, _, _, row_ids, homes = summary
    # (summary lengths are 0 for rows that are not live)
    state = paging.with_pools(state, pages.visit(paging.pools(state), live_mask, seq_lengths,
                                                 homes, self.k_max))
    # (from the host table: each pool gets its own buffer, so a segment may donate both)
    return with_page_table(state, pages.table(homes, row_ids))


class _Queue:
  """The caller's rows that wait for a slot: those not yet prefilled, in order, and the rows of
  one prefill (whole prompt groups, `prefill_rows`, padded past the queue's end) that found no
  free slot yet, held prefilled on the device. `admit` moves up to `refill` of them into free
  slots; a group's samples may take slots in different refills, each prefill done once. A
  paged run gives each admitted row its pages: a sample shares its prompt's pages with a
  sibling that still holds them on the same data-parallel replica, else it takes its own (the
  admission writes its prompt's KV through its own page table either way)."""

  def __init__(self, run: _Run, rows: np.ndarray, prompts, prompt_lengths, key, group: int,
               prefill_rows: int, refill: int, pages: paging.SlotPages | None,
               host_lengths: np.ndarray | None):
    self.run, self.rows = run, rows
    self.prompts, self.prompt_lengths, self.key = prompts, prompt_lengths, key
    self.group, self.prefill_rows, self.refill = group, prefill_rows, refill
    self.pages, self.host_lengths = pages, host_lengths
    # (its state, the caller's rows, -1 for padding; which of them still wait)
    self.pending: tuple | None = None
    self.prefills = 0
    self.owner: dict[int, tuple] = {}  # slot -> (prefill, group) of the row admitted there
    self.holders: dict[tuple, list[int]] = {}  # (prefill, group) -> slots admitted for it

  def waiting(self) -> int:
    return len(self.rows) + (0 if self.pending is None else int(self.pending[2].sum()))

  def admit(self, state: EngineState, free: np.ndarray):
    """Up to `refill` waiting rows into the `free` slots, in queue order: (state, the slots they
    took), or None when a paged run has pages for none of them."""
    if self.pending is None:
      rows = self.rows[:self.prefill_rows]
      self.rows = self.rows[len(rows):]
      ids = np.concatenate([rows, np.full(self.prefill_rows - len(rows), -1)]).astype(np.int32)
      take = np.where(ids >= 0, ids, rows[-1])
      self.prefills += 1
      self.pending = (self.run.prefill(*_admission_inputs(self.prompts, self.prompt_lengths,
                                                          self.key, jnp.asarray(take),
                                                          self.prefills), self.group),
                      ids, ids >= 0)
    new, ids, wait = self.pending
    into = np.zeros(self.prefill_rows, np.int32)
    row_ids = np.full(self.prefill_rows, -1, np.int32)
    free, taken = list(free), []
    for i in np.flatnonzero(wait):
      if len(taken) == self.refill or not free:
        break
      slot = free[0] if self.pages is None else self._place(i, int(ids[i]), free)
      if slot is None:  # no pages: the rest wait too (queue order)
        break
      free.remove(slot)
      into[i], row_ids[i], wait[i] = slot, ids[i], False
      taken.append(slot)
    if not taken:
      return None
    if not wait.any():
      self.pending = None
    if self.pages is None:
      return _admit(state, new, jnp.asarray(into), jnp.asarray(row_ids)), np.asarray(taken)
    table = jnp.asarray(self.pages.table(into, row_ids))
    return (paging.admit_paged(state, new, jnp.asarray(into), jnp.asarray(row_ids), table),
            np.asarray(taken))

  def _place(self, i: int, row: int, free: list[int]) -> int | None:
    """A free slot whose replica gives pending row `i` (the caller's `row`) its pages: beside a
    sibling that holds the group's prompt pages (shared), else the replica with the most free
    slots that has pages. None: no replica has them."""
    pages, key = self.pages, (self.prefills, i // self.group)
    seq_len = int(self.host_lengths[row]) + 1
    prefix = self.run.shared_prefix(int(self.host_lengths[row]), self.group)
    siblings = [s for s in self.holders.get(key, ())
                if self.owner.get(s) == key and s in pages and s not in free]
    by_replica = {}
    for slot in free:
      by_replica.setdefault(pages.replica_of(slot), []).append(slot)
    if siblings and prefix:
      near = by_replica.get(pages.replica_of(siblings[0]), [])
      if near and pages.admit_row(near[0], seq_len, self.run.k_max, siblings[0], prefix):
        return self._placed(near[0], key)
    for slots in sorted(by_replica.values(), key=len, reverse=True):
      if pages.admit_row(slots[0], seq_len, self.run.k_max):
        return self._placed(slots[0], key)
    return None

  def _placed(self, slot: int, key: tuple) -> int:
    self.owner[slot] = key
    self.holders.setdefault(key, []).append(slot)
    return slot


def run_engine(graphdef, params, drafter: Drafter | None, drafter_params, prompts: jax.Array,
               prompt_lengths: jax.Array, key: jax.Array, cfg: SamplingConfig, cache_size: int,
               engine: EngineConfig, mesh=None, tuning: EngineTuning | None = None) -> Rollout:
  """Sample completions with the engine (inputs already checked and the largest draft length
  resolved by `generate` / `speculative_generate`). `mesh` None: the mesh the params are sharded
  over, if any. `tuning` None: calibrate afresh for this call only."""
  mesh = params_mesh(params) if mesh is None else mesh
  if mesh is not None:
    from specjax.sharding.rules import shard_batch
    prompts, prompt_lengths = shard_batch((prompts, prompt_lengths), mesh)
  tuning = EngineTuning() if tuning is None else tuning
  return _Run(graphdef, params, drafter, drafter_params, cfg, cache_size, engine, mesh,
              tuning).run(prompts, prompt_lengths, key)
