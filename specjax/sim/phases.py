"""Phase models of one RL step: generation (AR or speculative, shrinking live batch), prefill,
logprob, train (with optional online draft adaptation) and prepare (weight hand-over).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math

import numpy as np

from specjax.sim import cost
from specjax.sim.catalog import HardwareSpec, ModelSpec
from specjax.sim.continuous_model import ContinuousEngineConfig, simulate_continuous
from specjax.sim.cost import Efficiency
from specjax.sim.drafter_costs import NO_DRAFT, DrafterCost
from specjax.sim.engine_cost import EngineCost
from specjax.sim.engine_model import EngineModelConfig, cumulative_rates, simulate_engine
from specjax.sim.workload import Workload


@dataclasses.dataclass(frozen=True)
class GenResult:
  seconds: float  # prefill + decode of the slowest replica
  prefill_s: float
  decode_s: float
  steps: float  # decode (or speculative) steps of the slowest replica
  replicas: int
  mp: int  # GPUs per generation replica
  rows_per_replica: int
  slots: int  # rows decoded concurrently (KV-cache capacity)
  acceptance_length: float
  engine_stats: dict = dataclasses.field(default_factory=dict)  # engine-specific counters


@functools.lru_cache(maxsize=256)
def _replica_lengths(workload: Workload, n: int) -> np.ndarray:
  """n quantile lengths; the longest is the expected longest of the whole step, since the step
  ends when the replica holding it finishes."""
  lengths = workload.response_lengths(n)
  lengths[-1] = max(lengths[-1], workload.longest_response())
  return np.round(lengths)


@functools.lru_cache(maxsize=64)
def _all_lengths(workload: Workload) -> np.ndarray:
  return np.round(workload.response_lengths(workload.rollouts))


def kv_slots(model: ModelSpec, hw: HardwareSpec, mp: int, workload: Workload, rows: int,
             memory_fraction: float, extra_weight_bytes: float = 0.0) -> int:
  """Rows one replica decodes at once: the KV budget over the KV of an average finished row."""
  budget = mp * hw.hbm_bytes * memory_fraction - model.weight_bytes - extra_weight_bytes
  per_row = model.kv_bytes_per_token * (workload.prompt_len + workload.mean_response_len)
  if budget < per_row:
    raise ValueError(f"{model.name} does not fit a {mp}-GPU {hw.name} replica with room for KV "
                     f"(weights {model.weight_bytes / 1e9:.0f} GB); raise gen_mp")
  return int(min(rows, budget // per_row))


def _queue_order(n: int) -> np.ndarray:
  """Arrival order of the n sorted rows: the longest first (it starts at once), the others in
  golden-ratio order, so every wave of a capacity-bound replica mixes short and long rows."""
  rest = np.argsort(np.modf(np.arange(n - 1) * 0.6180339887498949)[0])
  return np.concatenate([[n - 1], rest])


def _schedule(lengths: np.ndarray, slots: int, tokens_per_step: float, prompt_len: int,
              chunks: int):
  """Continuous batching as a fluid model: rows queue for `slots` slots and each takes the
  first slot that frees (greedy list scheduling); every step each busy row advances
  `tokens_per_step` tokens. Returns, per chunk of steps: its width in steps, the live rows and
  the total cached context at its midpoint, and the number of steps."""
  dur = lengths[_queue_order(len(lengths))] / tokens_per_step
  start = np.zeros_like(dur)
  if len(dur) > slots:
    free = [float(d) for d in dur[:slots]]
    heapq.heapify(free)
    for j in range(slots, len(dur)):
      start[j] = heapq.heappop(free)
      heapq.heappush(free, start[j] + dur[j])
  end = start + dur
  horizon = float(end.max())
  edges = np.linspace(0.0, horizon, chunks + 1)
  mid = 0.5 * (edges[1:] + edges[:-1])
  # live(s) = #{start <= s} - #{end <= s}; the same difference of prefix sums gives sum(start).
  by_start, by_end = np.argsort(start), np.argsort(end)
  cum_start = np.concatenate([[0.0], np.cumsum(start[by_start])])
  cum_start_by_end = np.concatenate([[0.0], np.cumsum(start[by_end])])
  ns = np.searchsorted(start[by_start], mid, side="right")
  ne = np.searchsorted(end[by_end], mid, side="right")
  live = (ns - ne).astype(float)
  sum_start = cum_start[ns] - cum_start_by_end[ne]
  ctx = live * prompt_len + tokens_per_step * (live * mid - sum_start)
  return np.diff(edges), live, ctx, horizon


def generation(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, gpus: int,
               workload: Workload, *, mp: int, drafter: DrafterCost = NO_DRAFT,
               draft_len: int = 0, acceptance_length: float = 1.0,
               draft_model: ModelSpec | None = None, rows_per_replica: int | None = None,
               memory_fraction: float = 0.85, chunks: int = 512) -> GenResult:
  """Rollout time of one step on `gpus` GPUs in replicas of `mp`: prefill, then decode steps
  whose cost follows the live batch and its context as responses finish. K = 0 or no drafter
  is plain autoregressive decoding."""
  if gpus < mp or gpus % mp:
    raise ValueError(f"generation: gpus={gpus} must be a positive multiple of mp={mp}")
  speculative = drafter.speculative and draft_len > 0
  acc = acceptance_length if speculative else 1.0
  replicas = gpus // mp
  rows = rows_per_replica or math.ceil(workload.rollouts / replicas)
  extra = drafter.weight_bytes(model, draft_model) if speculative else 0.0
  slots = kv_slots(model, hw, mp, workload, rows, memory_fraction, extra)
  lengths = _replica_lengths(workload, rows)
  width, live, ctx, horizon = _schedule(lengths, slots, acc, workload.prompt_len, chunks)
  if speculative:
    step = cost.spec_step_time(model, hw, eff, mp, live, ctx, draft_len, acc, drafter,
                               draft_model)
  else:
    step = cost.ar_step_time(model, hw, eff, mp, live, ctx)
  decode = float((width * step).sum())
  p = workload.prompt_len
  prefill = float(cost.forward_time(cost.target_net(model), hw, eff, mp, rows * p, rows * p,
                                    p / 2, eff.step_overhead_s, logit_tokens=rows))
  return GenResult(seconds=prefill + decode, prefill_s=prefill, decode_s=decode, steps=horizon,
                   replicas=replicas, mp=mp, rows_per_replica=rows, slots=slots,
                   acceptance_length=acc)


def generation_specjax(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, gpus: int,
                       workload: Workload, *, mp: int, drafter: DrafterCost = NO_DRAFT,
                       draft_len: int = 0, acceptance_length: float = 1.0,
                       draft_model: ModelSpec | None = None, adaptive: bool = False,
                       min_bucket: int = 8, rows_per_replica: int | None = None,
                       memory_fraction: float = 0.85) -> GenResult:
  """Rollout time of one step with specjax's engine (`engine_model.simulate_engine`): every
  replica allocates a static cache of prompt + max length + K + 1 per row, so it runs its rows
  in waves of at most that many; each wave starts in one bucket and compacts into smaller ones
  as rows finish (adaptive K per bucket if `adaptive`). Waves run one after another."""
  speculative = drafter.speculative and (draft_len > 0 or adaptive)
  replicas = gpus // mp
  rows = rows_per_replica or math.ceil(workload.rollouts / replicas)
  max_k = draft_len if speculative else 0
  n_max = workload.max_response_len
  cache = workload.prompt_len + n_max + max_k + 1
  extra = drafter.weight_bytes(model, draft_model) if speculative else 0.0
  budget = mp * hw.hbm_bytes * memory_fraction - model.weight_bytes - extra
  per_row = model.kv_bytes_per_token * cache
  if budget < per_row:
    raise ValueError(f"{model.name} does not fit a {mp}-GPU {hw.name} replica with a static "
                     f"cache of {cache} positions for one row; raise gen_mp")
  slots = int(min(rows, budget // per_row))
  waves = math.ceil(rows / slots)
  lengths = _replica_lengths(workload, rows)
  order = _queue_order(rows)  # the longest row first, then a mix of short and long rows
  rates = cumulative_rates(acceptance_length, max_k, decay=workload.acceptance_decay) \
      if speculative else []
  ec = EngineCost(model, hw, eff, (drafter if speculative else NO_DRAFT).name, draft_model, mp)
  seconds, prefill, iters = 0.0, 0.0, 0
  for w in range(waves):
    wave = lengths[order[w::waves]]
    b = len(wave)
    ecfg = EngineModelConfig(batch=b, prompt_len=workload.prompt_len, max_new=n_max,
                             draft_len=max_k if not adaptive else 0, max_draft_len=max_k,
                             adaptive=adaptive and speculative, min_bucket=min(min_bucket, b),
                             segment_overhead_s=eff.segment_overhead_s)
    pre = ec.prefill(b, workload.prompt_len, cache, max_k)
    run = simulate_engine(ecfg, wave, rates, ec.step, pre)
    seconds += run.seconds
    prefill += pre
    iters += run.iterations
  acc = acceptance_length if speculative else 1.0
  return GenResult(seconds=seconds, prefill_s=prefill, decode_s=seconds - prefill, steps=iters,
                   replicas=replicas, mp=mp, rows_per_replica=rows, slots=slots,
                   acceptance_length=acc)


def generation_continuous(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, gpus: int,
                          workload: Workload, *, mp: int, drafter: DrafterCost = NO_DRAFT,
                          draft_len: int = 0, acceptance_length: float = 1.0,
                          draft_model: ModelSpec | None = None, adaptive: bool = False,
                          min_bucket: int = 8, rows_per_replica: int | None = None,
                          memory_fraction: float = 0.85, max_rows: int | None = None,
                          **engine) -> GenResult:
  """Rollout time of one step with specjax's queue-fed paged engine
  (`continuous_model.simulate_continuous`): each replica's KV budget is a pool of pages, its
  rows queue in GRPO-group order for `max_rows` slots (default: as many rows as the budget
  holds at the KV of an average finished row, as the vLLM-like engine) and are refilled between
  segments. `engine`: further `ContinuousEngineConfig` fields (refill_fraction,
  refill_overhead_s, page_size, headroom_iters)."""
  speculative = drafter.speculative and (draft_len > 0 or adaptive)
  replicas = gpus // mp
  rows = rows_per_replica or math.ceil(workload.rollouts / replicas)
  max_k = draft_len if speculative else 0
  extra = drafter.weight_bytes(model, draft_model) if speculative else 0.0
  slots = max_rows or kv_slots(model, hw, mp, workload, rows, memory_fraction, extra)
  slots = min(slots, rows)
  budget = mp * hw.hbm_bytes * memory_fraction - model.weight_bytes - extra
  page_size = engine.get("page_size", ContinuousEngineConfig.page_size)
  num_pages = int(budget // (model.kv_bytes_per_token * page_size))
  if num_pages < 1:
    raise ValueError(f"{model.name} does not fit a {mp}-GPU {hw.name} replica with room for KV "
                     f"(weights {model.weight_bytes / 1e9:.0f} GB); raise gen_mp")
  cfg = ContinuousEngineConfig(
      batch=slots, prompt_len=workload.prompt_len, max_new=workload.max_response_len,
      draft_len=max_k if not adaptive else 0, max_draft_len=max_k,
      adaptive=adaptive and speculative, min_bucket=min(min_bucket, slots),
      segment_overhead_s=eff.segment_overhead_s, num_pages=num_pages,
      group_size=workload.samples, **engine)
  lengths = _replica_lengths(workload, rows)[_queue_order(rows)]
  rates = cumulative_rates(acceptance_length, max_k, decay=workload.acceptance_decay) \
      if speculative else []
  ec = EngineCost(model, hw, eff, (drafter if speculative else NO_DRAFT).name, draft_model, mp)
  run = simulate_continuous(cfg, lengths, rates, ec.paged_step,
                            lambda r, t, kv, q: ec.paged_prefill(r, t, kv, q, max_k))
  acc = acceptance_length if speculative else 1.0
  stats = {"refills": run.refills, "preemptions": run.preemptions,
           "recomputed_tokens": float(run.recomputed_tokens), "recompute_s": float(run.recompute_s),
           "refill_overhead_s": run.refill_overhead_s, "peak_live": run.peak_live,
           "peak_pages": run.peak_pages, "num_pages": num_pages, "segments": len(run.segments)}
  return GenResult(seconds=run.seconds, prefill_s=run.prefill_s,
                   decode_s=run.seconds - run.prefill_s, steps=run.iterations,
                   replicas=replicas, mp=mp, rows_per_replica=rows, slots=slots,
                   acceptance_length=acc, engine_stats=stats)


def expert_parallel(model: ModelSpec, hw: HardwareSpec, gpus: int) -> int:
  """Expert-parallel group of the learner: experts spread over the GPUs of one NVLink domain
  (a power of two, at most the expert count)."""
  ep = 1
  while ep * 2 <= min(gpus, hw.domain, model.num_experts):
    ep *= 2
  return ep


def all_to_all_time(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, gpus: int,
                    workload: Workload, passes: float) -> float:
  """Expert-parallel token exchange of `passes` forward-equivalents over every token of the
  step: per MoE layer each token's hidden state goes to its k experts and comes back
  (dispatch + combine), the (ep-1)/ep share of it leaving the GPU; not overlapped."""
  if not model.is_moe:
    return 0.0
  ep = expert_parallel(model, hw, gpus)
  if ep == 1:
    return 0.0
  tokens = float((workload.prompt_len + _all_lengths(workload)).sum()) / gpus
  link = (hw.nvlink_bw / 2 if ep <= hw.domain else hw.net_bw) * eff.comm
  per_layer = 2 * tokens * model.experts_per_token * model.hidden * model.bytes_per_param
  return passes * model.layers * per_layer * (ep - 1) / ep / link


def _forward_flops(model: ModelSpec, workload: Workload) -> float:
  """FLOPs of one forward over every rollout of the step (causal attention included)."""
  seq = workload.prompt_len + _all_lengths(workload)
  return (2.0 * model.active_params * float(seq.sum())
          + model.attn_flops_per_pair * float((seq * seq / 2).sum()))


def logprob_time(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, gpus: int,
                 workload: Workload, reference: bool = False) -> float:
  """Policy (and optionally reference) forward over all tokens at the fitted MFU."""
  passes = 2 if reference else 1
  return (passes * _forward_flops(model, workload) / (gpus * hw.flops * eff.mfu)
          + all_to_all_time(model, hw, eff, gpus, workload, passes))


def train_time(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, gpus: int,
               workload: Workload, online_drafter: DrafterCost = NO_DRAFT,
               ttt_steps: int = 3) -> float:
  """Forward + backward (3x forward FLOPs) over all tokens, plus the online adaptation of
  `online_drafter` over the same tokens (`online_train_flops`; none for most drafters)."""
  flops = 3.0 * _forward_flops(model, workload)
  tokens = float((workload.prompt_len + _all_lengths(workload)).sum())
  flops += online_drafter.online_train_flops(model, tokens, ttt_steps)
  # forward + backward exchange tokens twice as often as a forward (dispatch/combine and their
  # gradients)
  return flops / (gpus * hw.flops * eff.mfu) + all_to_all_time(model, hw, eff, gpus, workload,
                                                               2.0)


def prepare_time(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, mp: int,
                 colocated: bool) -> float:
  """Hand the new weights to the generation engine. Colocated: each GPU gathers its replica
  shard over NVLink, plus engine wake-up / train-state offload. Split groups (async): each
  generation GPU receives its shard over the scale-out network (pipelined broadcast)."""
  shard = model.weight_bytes / mp
  if colocated:
    return shard / (hw.nvlink_bw / 2 * eff.comm) + eff.prepare_overhead_s
  return shard / (hw.net_bw * eff.comm)
