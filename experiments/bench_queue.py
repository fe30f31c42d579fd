"""The engine on a GRPO-shaped queue: more rows than slots, long-tailed lengths. Does keeping the
slots full (continuous batching) beat running the queue in waves?

  python experiments/bench_queue.py --quick     # 32 prompts x G=4, 16 slots, max_new 256
  python experiments/bench_queue.py             # 64 prompts x G=4, 32 slots
  python experiments/bench_queue.py --layers 24 # a deeper target

Workload and target as in `bench_engine.py` (a synthetic Markov language, a target whose LM head
is fitted to it, an EOS set chosen so completion lengths are long-tailed: 10th/50th/90th
percentile near 10/25/100% of max_new_tokens), temperature 1. Arms (same prompts; every arm
compiles all its buckets before its first segment, as RL rollouts do (`compile_ahead`), runs once
untimed, then --repeats interleaved rounds):
  waves            AR, the queue cut into batches of `--slots` rows, one `generate` call each (the
                   engine without a queue: each batch waits for its longest row, compaction in
                   its tail)
  continuous       AR, one call, EngineConfig(max_rows=slots): finished rows' slots take waiting
                   rows between segments
  waves_spec       speculative in waves (draft model: the target's first --draft-layers layers)
  continuous_spec  speculative, one call with the queue, adaptive K
  continuous_noaccept  the no-acceptance control: continuous_spec's engine and queue with a draft
                   model of the same shape whose weights are random (init std 0.02: near-uniform
                   drafts, almost never accepted); adaptive K must make it cost no more than AR
  dense            AR with the queue at one KV budget (`--kv-budget-rows` dense rows' worth of
                   target KV memory): dense caches, so the budget holds that many slots
  paged            AR with the queue at the same budget, paged
                   (`EngineConfig.paging.kv_cache_gb`): up to --paged-slots slots (default
                   2 x --slots), rows admitted while pages are free, a GRPO group's samples
                   sharing their prompt pages
`--whole-cache-reads` makes every step's attention read its caches whole (in this process), for
a side-by-side with the default, which reads only their live part; `--no-single-pass` keeps the
chunk loop for steps whose furthest row reaches the last chunk (`cache.SUMS_MAX_QUERIES` = 0),
the other arm of a side-by-side with the default's one pass. Tokens/s counts completion
tokens; `rows.dense` / `rows.paged` are the rows each held at once
(paged: the most live rows any segment started with, and the step-weighted mean). Prints a
table, writes JSON (`arms.<arm>.tokens_per_s`, paired per-round ratios, the acceptance length
and the K the engine chose with the step costs it chose from, the queue arms' refill thresholds (`refill_at`: segments by the free
slots that made them return) and measured refill costs). Asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import bench_engine as be  # noqa: E402
from bench_io import write_json  # noqa: E402
from specjax.drafters import DraftModelDrafter, truncated_copy  # noqa: E402
from specjax.jobs import run_main  # noqa: E402
from specjax.models import Decoder, cache  # noqa: E402
from specjax.sampling import (AcceptanceMetrics, EngineConfig, EngineTuning,  # noqa: E402
                              SamplingConfig, generate, speculative_generate)
from specjax.sampling.engine_config import CompileConfig, PagingConfig, QueueConfig  # noqa: E402

ARMS = ("waves", "continuous", "waves_spec", "continuous_spec", "continuous_noaccept", "dense",
        "paged")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--quick", action="store_true", help="32 prompts, 16 slots, 1 round")
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--vocab", type=int, default=512)
  p.add_argument("--embed-scale", type=float, default=25.0)
  p.add_argument("--layer-scale", type=float, default=0.25)
  p.add_argument("--head-fit-steps", type=int, default=200)
  p.add_argument("--prompts", type=int, default=None, help="64 (--quick: 32)")
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--slots", type=int, default=None, help="32 (--quick: 16)")
  p.add_argument("--refill-fraction", type=float, default=EngineConfig.queue.refill_fraction)
  p.add_argument("--refill-from-costs", action=argparse.BooleanOptionalAction,
                 default=EngineConfig.queue.refill_from_costs,
                 help="choose the free slots that make a segment refill from measured costs "
                      "(else --refill-fraction throughout)")
  p.add_argument("--kv-budget-rows", type=int, default=None,
                 help="the dense and paged arms' KV budget, in dense rows (default: slots / 2)")
  p.add_argument("--paged-slots", type=int, default=None,
                 help="the paged arm's slots (default 2 x --slots: memory, not slots, limits it)")
  p.add_argument("--page-size", type=int, default=EngineConfig.paging.page_size)
  p.add_argument("--page-ahead", type=int, default=EngineConfig.paging.page_ahead)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--max-new", type=int, default=256)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--median-frac", type=float, default=0.25)
  p.add_argument("--draft-len", type=int, default=4, help="largest K")
  p.add_argument("--draft-layers", type=int, default=1)
  p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
  p.add_argument("--repeats", type=int, default=None, help="3 (--quick: 1)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--whole-cache-reads", action="store_true",
                 help="attention reads every KV cache whole (this process), not only the live "
                      "part a chunk at a time: the other arm of a side-by-side")
  p.add_argument("--no-single-pass", action="store_true",
                 help="steps that reach the caches' last chunk loop over chunks too (this "
                      "process), not one pass over the whole caches: the other arm of a "
                      "side-by-side")
  p.add_argument("--out", default="runs/bench_queue.json")
  a = p.parse_args(argv)
  quick = dict(prompts=32, slots=16, repeats=1) if a.quick else dict(prompts=64, slots=32,
                                                                      repeats=3)
  for k, v in quick.items():
    if getattr(a, k) is None:
      setattr(a, k, v)
  a.target, a.init_std = "markov", 0.02
  return a


def markov_target(a, log):
  """The queue's workload and target at `a`'s shape and seed (`bench_engine`'s Markov language, a
  target whose LM head is fitted to it, an EOS set for long-tailed lengths, the prompts; sets
  `a.language`): (target, its ModelConfig, EOS ids, the EOS choice's length quantiles / max_new,
  prompts, prompt lengths). `peer_vllm.py --trained-queue` builds the same one."""
  target, cfg_m, rng, eos, quantiles = be.markov_target(a, log)
  prompts, lens = be.make_prompts(a, rng, a.prompts)
  return target, cfg_m, eos, quantiles, prompts, lens


def main(argv=None) -> dict:
  a = parse_args(argv)
  log = lambda s: print(s, flush=True)
  t_start = time.perf_counter()
  if a.whole_cache_reads:  # read at trace time: set before any program is traced
    cache.CACHE_CHUNK_MIN_BYTES = sys.maxsize
  if a.no_single_pass:
    cache.SUMS_MAX_QUERIES = 0
  target, cfg_m, eos, quantiles, prompts, lens = markov_target(a, log)
  cfg = SamplingConfig(max_new_tokens=a.max_new, temperature=a.temperature, eos_ids=eos)
  rows = prompts.shape[0]
  log(f"target {cfg_m.num_params() / 1e6:.1f}M parameters; queue {a.prompts} prompts x "
      f"G={a.group} = {rows} rows, {a.slots} slots, max_new {a.max_new}; EOS set of {len(eos)} "
      f"(length quantiles / max_new on a choice sample: {quantiles})")
  draft = truncated_copy(target, a.draft_layers)
  drafter, dparams = DraftModelDrafter.from_model(draft, draft_len=a.draft_len)
  # the no-acceptance control's drafter: the same shape, random weights (near-uniform drafts)
  noise = Decoder(dataclasses.replace(draft.cfg, init_std=0.02), rngs=nnx.Rngs(a.seed + 99))
  noise_drafter, noise_params = DraftModelDrafter.from_model(noise, draft_len=a.draft_len)
  tunings = collections.defaultdict(EngineTuning)
  # every bucket compiled (and timed) before the first segment, as RL rollouts do, so that no
  # timed call compiles a bucket the untimed one did not reach
  queue = EngineConfig(queue=QueueConfig(max_rows=a.slots, refill_fraction=a.refill_fraction,
                                         refill_from_costs=a.refill_from_costs),
                       compile=CompileConfig(ahead=True))
  plain = EngineConfig(compile=CompileConfig(ahead=True))
  # one KV budget: what `budget_rows` dense rows take (AR: prompt + max_new positions each)
  budget_rows = a.kv_budget_rows or max(a.slots // 2, a.group)
  token_bytes = 2 * cfg_m.num_layers * cfg_m.num_kv_heads * cfg_m.head_dim * 4
  budget_gb = budget_rows * (prompts.shape[1] + a.max_new) * token_bytes / 2**30
  dense = EngineConfig(queue=QueueConfig(max_rows=budget_rows, refill_fraction=a.refill_fraction,
                                         refill_from_costs=a.refill_from_costs),
                       compile=CompileConfig(ahead=True))
  paged = EngineConfig(queue=QueueConfig(max_rows=a.paged_slots or 2 * a.slots,
                                         refill_fraction=a.refill_fraction,
                                         refill_from_costs=a.refill_from_costs),
                       paging=PagingConfig(kv_cache_gb=budget_gb, page_size=a.page_size,
                                           page_ahead=a.page_ahead),
                       compile=CompileConfig(ahead=True))

  def waves(i: int, spec: bool):
    outs = []
    for w in range(0, rows, a.slots):
      key = jax.random.fold_in(jax.random.key(i), w)
      p, n = prompts[w:w + a.slots], lens[w:w + a.slots]
      if spec:
        outs.append(speculative_generate(target, drafter, dparams, p, n, key, cfg, engine=plain,
                                         tuning=tunings["waves_spec"]))
      else:
        outs.append(generate(target, p, n, key, cfg, engine=plain, tuning=tunings["waves"]))
    return outs

  def continuous(i: int, spec: bool, accept: bool = True):
    key = jax.random.key(i)
    if spec and not accept:
      return [speculative_generate(target, noise_drafter, noise_params, prompts, lens, key, cfg,
                                   engine=queue, tuning=tunings["continuous_noaccept"])]
    if spec:
      return [speculative_generate(target, drafter, dparams, prompts, lens, key, cfg,
                                   engine=queue, tuning=tunings["continuous_spec"])]
    return [generate(target, prompts, lens, key, cfg, engine=queue,
                     tuning=tunings["continuous"])]

  def at_budget(i: int, name: str):
    return [generate(target, prompts, lens, jax.random.key(i), cfg,
                     engine=dense if name == "dense" else paged, tuning=tunings[name])]

  fns = {"waves": lambda i: waves(i, False), "continuous": lambda i: continuous(i, False),
         "waves_spec": lambda i: waves(i, True), "continuous_spec": lambda i: continuous(i, True),
         "continuous_noaccept": lambda i: continuous(i, True, accept=False),
         "dense": lambda i: at_budget(i, "dense"), "paged": lambda i: at_budget(i, "paged")}
  fns = {k: fns[k] for k in a.arms}
  first, runs = {}, {k: {"seconds": [], "tokens": []} for k in fns}
  for name, fn in fns.items():
    t0 = time.perf_counter()
    jax.block_until_ready([o.tokens for o in fn(0)])
    first[name] = time.perf_counter() - t0
    log(f"  {name}: first call (compiles, calibrates) {first[name]:.1f} s")
  last = {}
  for r in range(a.repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      outs = fn(r + 1)
      jax.block_until_ready([o.tokens for o in outs])
      runs[name]["seconds"].append(time.perf_counter() - t0)
      runs[name]["tokens"].append(int(sum(np.asarray(o.lengths).sum() for o in outs)))
      last[name] = outs
  arms = {}
  for name, r in runs.items():
    rate = [t / s for t, s in zip(r["tokens"], r["seconds"])]
    rec = {"tokens_per_s": statistics.median(rate), "seconds": r["seconds"],
           "tokens": r["tokens"], "first_call_s": first[name],
           "segments": sum(len(o.segments) for o in last[name])}
    if name.endswith("spec") or name == "continuous_noaccept":
      counts = [AcceptanceMetrics.from_counts(o.stats) for o in last[name]]
      drafts = sum(c.num_drafts for c in counts)
      accepted = sum(c.num_accepted_tokens for c in counts)
      rec["acceptance_length"] = 1 + accepted / max(drafts, 1)
      steps = collections.Counter()
      for o in last[name]:
        for s in o.segments:
          steps[s.draft_len] += s.iterations
      rec["steps_by_k"] = {int(k): int(v) for k, v in sorted(steps.items())}
    if name in ("continuous", "continuous_spec", "continuous_noaccept", "dense", "paged"):
      # the free slots that made each segment return to refill (chosen from measured costs),
      # and those costs: fixed seconds per refill, prefill seconds per row
      at = collections.Counter(s.refill_at for o in last[name] for s in o.segments if s.refill_at)
      rec["refill_at"] = {int(k): int(v) for k, v in sorted(at.items())}
      rec["refill_costs"] = [{"fixed_s": c["segment_s"], "prefill_s": c["step_s"],
                              "prefill_rows": int(c["key"].split("/")[-2])}
                             for c in tunings[name].to_json()["costs"]
                             if c["key"].endswith("/-1")]
    if name in ("continuous_spec", "continuous_noaccept", "waves_spec"):
      # the step costs the K choices read (seconds per step by bucket and K)
      rec["calibration"] = tunings[name].calibration_table()
    if name in ("dense", "paged"):
      segs = [s for o in last[name] for s in o.segments]
      steps = sum(s.iterations for s in segs)
      rec["rows_max"] = budget_rows if name == "dense" else max(s.live_rows_start for s in segs)
      rec["rows_mean"] = sum(s.live_rows_start * s.iterations for s in segs) / max(steps, 1)
      rec["swapped_out"] = sum(s.swapped_out for s in segs)
    arms[name] = rec

  def ratio(num: str, den: str) -> float | None:
    if num not in runs or den not in runs:
      return None
    return statistics.median(
        (tn / sn) / (td / sd) for tn, sn, td, sd in zip(runs[num]["tokens"], runs[num]["seconds"],
                                                        runs[den]["tokens"], runs[den]["seconds"]))

  ratios = {"continuous/waves": ratio("continuous", "waves"),
            "continuous_spec/waves": ratio("continuous_spec", "waves"),
            "continuous_spec/continuous": ratio("continuous_spec", "continuous"),
            "waves_spec/waves": ratio("waves_spec", "waves"),
            "continuous_noaccept/continuous": ratio("continuous_noaccept", "continuous"),
            "paged/dense": ratio("paged", "dense")}
  log(f"\n{'arm':>16} {'tokens/s':>9} {'first s':>8} {'segments':>9} {'acc len':>8}  "
      f"steps by K / segments by refill threshold")
  for name, r in arms.items():
    acc = f"{r['acceptance_length']:8.2f}" if "acceptance_length" in r else f"{'':>8}"
    log(f"{name:>16} {r['tokens_per_s']:9.0f} {r['first_call_s']:8.1f} {r['segments']:9d} {acc}  "
        f"{r.get('steps_by_k', '')} {r.get('refill_at', '')}")
  for k, v in ratios.items():
    if v is not None:
      log(f"{k:>28}: {v:.2f}x (median of paired rounds)")
  rows_held = {k: {"max": arms[k]["rows_max"], "mean": arms[k]["rows_mean"]}
               for k in ("dense", "paged") if k in arms}
  if rows_held:
    log(f"KV budget {budget_gb * 1024:.1f} MiB ({budget_rows} dense rows): rows held "
        + ", ".join(f"{k} max {v['max']} / mean {v['mean']:.1f}" for k, v in rows_held.items()))
  summary = {"benchmark": "queue", "machine": be.machine(), "command": "python experiments/bench_queue.py " + " ".join(
                 sys.argv[1:] if argv is None else argv),
             "config": {k: v for k, v in vars(a).items() if k != "language"},
             "target_params": cfg_m.num_params(), "eos": list(eos), "length_quantiles": quantiles,
             "arms": arms, "ratios": ratios, "rows": rows_held,
             "kv_budget": {"gb": budget_gb, "dense_rows": budget_rows},
             "wall_s": time.perf_counter() - t_start}
  write_json(a.out, summary)
  log(f"wrote {a.out} ({summary['wall_s']:.0f} s)")
  return summary


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
