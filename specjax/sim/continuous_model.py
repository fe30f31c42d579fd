"""A model of specjax's queue-fed rollout engine: a pool of row slots over paged KV memory,
refilled between segments.

The engine holds `batch` row slots (its static program batch, `max_rows`). Waiting rows queue in
GRPO-group order; between segments the host admits them into free slots (a group's prompt is
prefilled once and its full pages shared by the group's resident rows) as long as free KV pages
allow. Inside a segment every live row advances E tokens per iteration and takes pages as it
grows; a finished row's pages return at the segment's end. A segment returns to the host when
`refill_fraction` of the slots are free and rows wait (a refill: one host round trip + a prefill
of the admitted prompts), when the pages run out (the host preempts the most recently admitted
rows; they rejoin the queue's front and recompute their prompt and generated tokens when
readmitted, losing no tokens), at the adaptive K policy's iteration budget (the engine's
`DraftLenPolicy.budget`), or, once the queue is empty (the drain), when the live rows fit the
next smaller bucket (compaction, the engine's `bucket_sizes`). K is chosen per segment as the
static engine's model does: argmax_K E[tokens per step | K] / step cost.

Pure numpy. `simulate_continuous(cfg, lengths, rates, step_cost, prefill_cost)`: `step_cost(bucket,
K, kv_tokens)` is the seconds of one iteration of `bucket` slots whose live rows attend to
`kv_tokens` cached positions in total (paged: the positions they hold, not a dense window);
`prefill_cost(rows, tokens, kv_tokens, queries_per_row)` the seconds of one prefill forward.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Callable, Sequence

import numpy as np

from specjax.config_tree import refuse
from specjax.sampling.adaptive import RefillPolicy
from specjax.sim.engine_model import EngineModelConfig, effective_lengths, tokens_per_step


def _check(cond: bool, field: str, msg: str) -> None:
  if not cond:
    refuse(f"ContinuousEngineConfig.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class ContinuousEngineConfig(EngineModelConfig):
  """`batch` is the slot pool (max_rows: the program's static batch while rows wait); `compact`
  compacts the live rows into buckets only in the drain. Pages: `num_pages` of `page_size`
  tokens (0: unlimited); a GRPO group of `group_size` consecutive queue rows shares its prompt's
  full pages. `refill_fraction`: share of the slots that must be free (with rows waiting) for a
  segment to return and refill; `refill_overhead_s`: host work per refill (device->host sync,
  admission and page tables, the prefill's dispatch) on top of the prefill itself.
  `refill_from_costs`: once rows have finished, the free slots that make a segment return come
  from the costs instead, as the engine's default does (`specjax.sampling.adaptive.best_refill`:
  a refill's fixed cost `refill_overhead_s` + `segment_overhead_s` and one row's share of a
  group's prompt prefill against the idle slots, at the step cost of the full pool and the rate
  rows finish, a running count decayed 0.7 per segment); False (the recorded projections):
  `refill_fraction` throughout.
  `headroom_iters`: admission leaves, and preemption frees, pages for this many iterations of
  the live rows' growth (so an admitted row is not preempted at once)."""

  windowed: bool = False  # paged attention reads the pages a row holds: no window
  num_pages: int = 0
  page_size: int = 16
  group_size: int = 1
  refill_fraction: float = 0.125
  refill_overhead_s: float = 5e-3
  refill_from_costs: bool = False
  headroom_iters: int = 16
  cost_chunks: int = 8  # a segment's cost is summed over this many chunks (of >= 16 iterations)

  def __post_init__(self):
    super().__post_init__()
    _check(not self.windowed, "windowed", "a paged engine attends over held pages, no window")
    for f in ("page_size", "group_size", "headroom_iters", "cost_chunks"):
      _check(getattr(self, f) >= 1, f, f"must be >= 1, got {getattr(self, f)}")
    _check(self.num_pages >= 0, "num_pages", f"must be >= 0 (0: unlimited), got {self.num_pages}")
    _check(0 < self.refill_fraction <= 1, "refill_fraction",
           f"must be in (0, 1], got {self.refill_fraction}")
    _check(self.refill_overhead_s >= 0, "refill_overhead_s",
           f"must be >= 0, got {self.refill_overhead_s}")
    if self.num_pages:
      need = self.row_pages(self.max_new)
      _check(need <= self.num_pages, "num_pages",
             f"{self.num_pages} pages of {self.page_size} tokens cannot hold one row of "
             f"prompt {self.prompt_len} + {self.max_new} tokens ({need} pages)")

  @property
  def shared_prompt_pages(self) -> int:
    """Full prompt pages a group shares (its partly filled last page is copied per row)."""
    return self.prompt_len // self.page_size if self.group_size > 1 else 0

  @property
  def private_offset(self) -> int:
    """Prompt tokens on a row's own pages."""
    return self.prompt_len - self.shared_prompt_pages * self.page_size

  @property
  def refill_slots(self) -> int:
    """Free slots that make a segment return to refill."""
    return max(1, math.ceil(self.refill_fraction * self.batch))

  def row_pages(self, generated) -> np.ndarray:
    """Pages a row holds with `generated` tokens after its first (which the prefill samples),
    including the K + 1 positions a verify writes past them and the shared prompt pages."""
    return (np.ceil((self.private_offset + 1 + np.asarray(generated, float)
                     + self.max_draft_len + 1) / self.page_size) + self.shared_prompt_pages)


@dataclasses.dataclass(frozen=True)
class ContinuousSegment:
  """One segment and the host visit before it: its program (bucket, K), iterations, live rows
  and cached positions at its start, seconds (the host visit's included), tokens committed, and
  what the host did first (rows admitted, their prefill seconds, rows preempted)."""

  bucket: int
  draft_len: int
  iterations: int
  live_rows_start: int
  kv_tokens: int
  seconds: float
  tokens: float
  admitted: int = 0
  prefill_s: float = 0.0
  preempted: int = 0


@dataclasses.dataclass(frozen=True)
class ContinuousRun:
  seconds: float  # refills (host + prefill) + segments
  prefill_s: float  # every prefill, recomputation included
  refill_overhead_s: float  # host work of the refills and preemptions
  recompute_s: float  # share of prefill_s spent recomputing preempted rows
  segments: tuple[ContinuousSegment, ...]
  refills: int
  preemptions: int  # rows preempted (a row preempted twice counts twice)
  recomputed_tokens: float  # generated tokens recomputed on readmission
  peak_live: int  # most rows held at once
  peak_pages: int  # most pages held at once (0 when the pool is unlimited)
  tokens: float  # tokens committed after each row's first

  @property
  def iterations(self) -> int:
    return sum(s.iterations for s in self.segments)

  def to_dict(self) -> dict:
    d = {k: v for k, v in dataclasses.asdict(self).items() if k != "segments"}
    d["iterations"] = self.iterations
    d["segments"] = [dataclasses.asdict(s) for s in self.segments]
    return d


def _best_k(cfg: ContinuousEngineConfig, bucket: int, kv: float, rates, step_cost) -> int:
  """Adaptive K of a segment: argmax_K E[tokens per step | K] / cost(bucket, K, kv)."""
  if not cfg.adaptive:
    return cfg.draft_len
  return max(range(cfg.max_draft_len + 1),
             key=lambda k: tokens_per_step(rates, k)[0] / step_cost(bucket, k, kv))


def simulate_continuous(cfg: ContinuousEngineConfig, lengths: Sequence[float],
                        rates: Sequence[float],
                        step_cost: Callable[[int, int, float], float],
                        prefill_cost: Callable[[int, float, float, float], float]
                        ) -> ContinuousRun:
  """Segments and refills of `len(lengths)` rows (completion lengths in queue order, the first
  token sampled by the prefill) through `cfg.batch` slots. Acceptance noise is folded into each
  row's work as in `engine_model.simulate_engine`; a row's KV follows its true tokens."""
  gen = np.clip(np.asarray(lengths, float), 1, cfg.max_new) - 1.0  # tokens after the first
  n = len(gen)
  if n == 0:
    raise ValueError("simulate_continuous: no rows")
  if len(rates) < cfg.max_draft_len and (cfg.adaptive or cfg.draft_len):
    raise ValueError(f"simulate_continuous: rates need max_draft_len={cfg.max_draft_len} "
                     f"entries, got {len(rates)}")
  B, P = cfg.batch, cfg.prompt_len
  buckets = cfg.buckets() if cfg.compact else [B]
  # work per row in committed tokens, acceptance noise at the K the first segment would choose,
  # assigned by length rank (as the static engine's model)
  noise_k = _best_k(cfg, B, float(min(n, B)) * (P + 1), rates, step_cost)
  rank = np.argsort(gen, kind="stable")
  work = np.empty(n)
  work[rank] = effective_lengths(gen[rank], *tokens_per_step(rates, noise_k))
  work = np.maximum(work, 1e-9)
  done = np.zeros(n)  # committed work (the KV holds gen * done / work tokens)
  state = np.zeros(n, np.int8)  # 0 waiting, 1 live, 2 finished
  stamp = np.full(n, -1)  # admission order (the newest is preempted first)
  group = np.arange(n) // cfg.group_size
  queue = collections.deque(range(n))
  limit = cfg.num_pages or math.inf
  # pages kept free at admission / freed by preemption: headroom_iters of growth at the largest
  # tokens per step any K gives (so a segment after a host visit always runs that long)
  head = cfg.headroom_iters * tokens_per_step(
      rates, cfg.max_draft_len if cfg.adaptive else cfg.draft_len)[0]
  policy = cfg.draft_len_policy()
  per_bucket, last_k = {}, {}
  clock = 0
  segments: list[ContinuousSegment] = []
  seconds = prefill_total = host_total = recompute_total = recomputed = 0.0
  refills = preemptions = peak_live = peak_pages = 0
  blocked = False  # admission found too few pages: retry once a row has finished
  refill = RefillPolicy(B, 1, cfg.refill_slots)  # free slots that make a segment return
  if cfg.refill_from_costs:
    refill.costs = (cfg.refill_overhead_s + cfg.segment_overhead_s,
                    float(prefill_cost(1, P, P, P / 2.0)) / cfg.group_size)
  refill_at = cfg.refill_slots

  def kv_tokens(rows, extra_work):
    """Generated tokens held by `rows` after `extra_work` more committed work each."""
    return gen[rows] * np.minimum((done[rows] + extra_work) / work[rows], 1.0)

  def pages(rows, extra_work):
    if not len(rows):
      return 0.0
    held = cfg.row_pages(kv_tokens(rows, extra_work)) - cfg.shared_prompt_pages
    return float(held.sum() + cfg.shared_prompt_pages * len(np.unique(group[rows])))

  while True:
    # -- host visit between segments: preempt if the pages run short, then refill -------------
    live = np.flatnonzero(state == 1)
    admitted, victims, pre_s, host_s = 0, 0, 0.0, 0.0
    if cfg.num_pages and len(live) > 1 and pages(live, head) > limit:
      order = live[np.argsort(-stamp[live])]  # newest first
      cut = 0
      while cut < len(order) - 1 and pages(order[cut:], head) > limit:
        cut += 1
      out = order[:cut]
      for r in out:  # newest first to the front: the oldest victim ends up first
        state[r] = 0
        queue.appendleft(int(r))
      victims = len(out)
      preemptions += victims
      blocked = True  # readmission waits for a row to finish
      host_s = cfg.refill_overhead_s
      live = np.flatnonzero(state == 1)
    free_slots = B - len(live)
    if queue and (not segments or not len(live) or
                  (free_slots >= refill_at and not blocked)):
      used = pages(live, head)
      cand = np.fromiter(itertools.islice(queue, free_slots), int)
      g = group[cand]
      first = np.zeros(len(cand), bool)
      first[np.unique(g, return_index=True)[1]] = True
      new_group = first & ~np.isin(g, group[live])  # the group's prompt is prefilled once
      need = cfg.row_pages(kv_tokens(cand, head)) - np.where(new_group, 0,
                                                              cfg.shared_prompt_pages)
      admitted = int(np.searchsorted(used + np.cumsum(need), limit, side="right"))
      cand, new_group = cand[:admitted], new_group[:admitted]
      for _ in range(admitted):
        queue.popleft()
      state[cand], stamp[cand] = 1, clock + np.arange(admitted)
      clock += admitted
      d = kv_tokens(cand, 0.0)  # > 0: a preempted row, whose generated tokens are recomputed
      joins = ~new_group & (d == 0)  # a sample joining its resident group: the prompt's last
      #                                position gives its first token
      p_tokens = P * new_group.sum() + d.sum() + joins.sum()
      p_ctx = P * (new_group.sum() + (d > 0).sum() + joins.sum()) + d.sum()
      p_pairs = P * P / 2.0 * new_group.sum() + (d * (P + d / 2.0)).sum() + P * joins.sum()
      rec_tokens = float(d.sum())
      blocked = bool(queue) and len(live) + admitted < B
      host_s = cfg.refill_overhead_s
      if admitted:
        pre_s = float(prefill_cost(admitted, p_tokens, p_ctx, p_pairs / p_ctx))
        if rec_tokens:
          recompute_total += pre_s * rec_tokens / float(p_tokens)
          recomputed += rec_tokens
      refills += 1
      live = np.flatnonzero(state == 1)
    prefill_total += pre_s
    host_total += host_s
    if not len(live):
      if queue:
        raise RuntimeError("simulate_continuous: no row admitted into an empty pool")
      break
    peak_live = max(peak_live, len(live))
    # -- one device segment ----------------------------------------------------------------------
    bi = 0
    if not queue and cfg.compact:  # the drain: compaction into the smallest bucket holding them
      while bi + 1 < len(buckets) and len(live) <= buckets[bi + 1]:
        bi += 1
    bucket = buckets[bi]
    kv0 = float((P + 1 + kv_tokens(live, 0.0)).sum())
    k = _best_k(cfg, bucket, kv0, rates, step_cost)
    mean = tokens_per_step(rates, k)[0]
    rem = np.sort((work[live] - done[live]) / mean)  # iterations each live row still needs
    limits = [rem[-1]]
    if queue:  # return when enough slots are free (one finish when admission was blocked)
      if bucket == B:
        refill_at = refill.threshold(float(step_cost(B, k, kv0)))
      need = 1 if blocked else refill_at - free_slots + admitted
      limits.append(rem[min(max(need, 1), len(rem)) - 1])
    elif cfg.compact and bi + 1 < len(buckets):
      limits.append(rem[len(rem) - buckets[bi + 1] - 1])
    iters = max(1, math.ceil(min(limits) - 1e-9))
    j = per_bucket.get(bucket, 0) if last_k.get(bucket) in (None, k) else 0
    per_bucket[bucket], last_k[bucket] = j + 1, k
    iters = min(iters, policy.budget(k, j))
    policy.ran(k, iters)  # (AR steps fade the counts, as in the engine)
    if cfg.num_pages:  # return when the pages run out
      if pages(live, iters * mean) > limit:
        lo, hi = 0, iters  # the largest lo with pages(lo iterations) <= limit
        while hi - lo > 1:
          mid = (lo + hi) // 2
          lo, hi = (mid, hi) if pages(live, mid * mean) <= limit else (lo, mid)
        iters = max(lo, 1)
      peak_pages = max(peak_pages, int(pages(live, iters * mean)))
    # cost: summed over chunks at their midpoint's live rows and cached positions
    run_s, start, chunk = 0.0, 0, max(16, math.ceil(iters / cfg.cost_chunks))
    while start < iters:
      width = min(chunk, iters - start)
      mid_work = (start + width / 2.0) * mean
      alive = live[done[live] + mid_work < work[live]]
      kv = float((P + 1 + kv_tokens(alive, mid_work)).sum()) if len(alive) else 0.0
      run_s += width * float(step_cost(bucket, k, kv))
      start += width
    before = kv_tokens(live, 0.0)
    done[live] = np.minimum(done[live] + iters * mean, work[live])
    tokens = float((kv_tokens(live, 0.0) - before).sum())
    if k > 0:  # the drafts behind the engine's acceptance estimate
      drafts = tokens / mean
      policy.estimate.add(k, drafts, drafts * np.asarray(rates[:k], float))
    finished = live[done[live] >= work[live] - 1e-9]
    if queue and bucket == B:
      refill.observe(len(finished), iters)
    if len(finished):
      state[finished] = 2
      blocked = False
    seg_s = host_s + pre_s + run_s + cfg.segment_overhead_s
    seconds += seg_s
    segments.append(ContinuousSegment(bucket, k, iters, len(live), int(kv0), seg_s, tokens,
                                      admitted, pre_s, victims))
  return ContinuousRun(seconds=seconds, prefill_s=prefill_total, refill_overhead_s=host_total,
                       recompute_s=recompute_total, segments=tuple(segments), refills=refills,
                       preemptions=preemptions, recomputed_tokens=recomputed,
                       peak_live=peak_live, peak_pages=peak_pages,
                       tokens=float(sum(s.tokens for s in segments)))
