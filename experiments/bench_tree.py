"""Draft trees against chains: the same drafter verified as a chain of K drafts (tree width 1) and
as a tree of width W (the chain plus, at each depth, the drafter's W - 1 next most likely tokens,
tried where the chain's draft is rejected), at small live batches.

  python experiments/bench_tree.py --quick          # batches 1 and 4, widths 1 and 3
  python experiments/bench_tree.py                  # batches 1, 2, 4; widths 1, 2, 3

The target, workload and drafters are `bench_engine.py`'s (a 25.7M-parameter Markov-language
target, temperature 1, long-tailed lengths; `draft_model`: its first layer; `eagle3`: a head
trained offline by the TTT loss). Per batch and drafter, arms `<drafter>_w<W>` (`_w<W>d<D>`:
alternatives at the first D depths only, `--depths`; a final `t`: the tree's chain of the
drafter's most likely tokens, `--chains argmax`): the plain loop at fixed K (`--k`), every row
stepped to the end (so the live batch is the batch), and
`<drafter>_w<W>_adaptive`: the engine's defaults (compaction, K chosen per bucket from measured
costs; with W > 1 the chain or the tree per segment, whichever promises more). Arms run
interleaved (`bench_engine.interleaved_runs`) after an untimed call each; tokens/s over the timed
calls, and over the timed calls' steps the acceptance length, the seconds and tokens per step
(their ratio against the chain's: "per step", free of per-call costs) and the share of drafting
steps that verified a tree. Prints a table, writes JSON. Asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from experiments import bench_engine as be  # noqa: E402
from specjax.drafters import (DraftModelDrafter, DraftTrainConfig, eagle3_drafter,  # noqa: E402
                              train_draft_head, truncated_copy)
from specjax.jobs import run_main  # noqa: E402
from specjax.sampling import (STATIC, AcceptanceMetrics, EngineConfig,  # noqa: E402
                              EngineTuning, SamplingConfig, speculative_generate)
from specjax.sampling.engine_config import CompileConfig  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="batches 1 and 4, widths 1 and 3")
  p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
  p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3])
  p.add_argument("--depths", type=int, nargs="+", default=[0],
                 help="tree depths D of the tree arms (alternatives at the first D depths; 0: "
                      "every depth); arms <drafter>_w<W>d<D> for D > 0")
  p.add_argument("--chains", nargs="+", default=["sampled"], choices=("sampled", "argmax"),
                 help="the tree arms' chains: drawn from the drafter (sampled) or its most "
                      "likely tokens (argmax: `Drafter.tree_argmax`; arms <drafter>_w<W>...t)")
  p.add_argument("--k", type=int, default=3, help="K of the plain-loop arms")
  p.add_argument("--max-draft-len", type=int, default=4, help="largest K of the adaptive arms")
  p.add_argument("--drafters", nargs="+", default=["draft_model", "eagle3"],
                 choices=["draft_model", "eagle3"])
  p.add_argument("--no-adaptive", action="store_true", help="plain-loop arms only")
  p.add_argument("--max-new", type=int, default=96)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--eagle-steps", type=int, default=30)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/bench_tree.json")
  a = p.parse_args(argv)
  if a.quick:
    a.batches, a.widths, a.repeats = [1, 4], [1, 3], min(a.repeats, 3)
  for w in a.widths:
    if w < 1:
      p.error(f"--widths: each must be >= 1, got {w}")
  for d in a.depths:
    if d < 0:
      p.error(f"--depths: each must be >= 0 (0: every depth), got {d}")
  if 1 not in a.widths:
    a.widths = [1] + a.widths  # the chain is the baseline every ratio is taken against
  return a


def engine_args(a) -> argparse.Namespace:
  """bench_engine's target and workload settings (its defaults) with this benchmark's lengths."""
  b = be.parse_args([])
  b.max_new, b.seed, b.group = a.max_new, a.seed, 1
  return b


def main(argv=None) -> dict:
  a = parse_args(argv)
  log = lambda s: print(s, flush=True)
  t_start = time.perf_counter()
  b = engine_args(a)
  target, cfg_m, rng, eos, quantiles = be.markov_target(b, log)
  cfg = SamplingConfig(max_new_tokens=a.max_new, temperature=b.temperature, eos_ids=eos)
  log(f"target {cfg_m.num_params() / 1e6:.1f}M, EOS set of {len(eos)}, length quantiles "
      f"{quantiles}")
  drafters = {}
  if "draft_model" in a.drafters:
    drafters["draft_model"] = DraftModelDrafter.from_model(truncated_copy(target, 1),
                                                           draft_len=a.k)
  if "eagle3" in a.drafters:
    old_group, b.group = b.group, 4
    p_train, l_train = be.make_prompts(b, rng, 32)
    b.group = old_group
    result = train_draft_head(target, p_train, l_train, sampling=cfg, progress=False,
                              config=DraftTrainConfig(steps=a.eagle_steps, batch_size=16,
                                                      lr=b.eagle_lr, draft_vocab=b.draft_vocab,
                                                      seed=a.seed, warmup_steps=10,
                                                      rollout_batch=64))
    embed = nnx.split(target)[1]["embed"][...]
    drafters["eagle3"] = eagle3_drafter(result.head, embed, result.maps, draft_len=a.k,
                                        temperature=b.temperature)
  results = {}
  for batch in a.batches:
    prompts, lens = be.make_prompts(b, rng, batch)
    key = lambda i: jax.random.key(a.seed * 1000 + i)
    runs = {}
    for name, (drafter, params) in drafters.items():  # one drafter's arms at a time
      arms = {}
      shapes = [(w, depth, top) for w in a.widths for depth in (a.depths if w > 1 else [0])
                for top in ([c == "argmax" for c in a.chains] if w > 1 else [False])]
      for w, depth, top in shapes:
        d = dataclasses.replace(drafter, tree_width=w, tree_depth=depth, tree_argmax=top)
        arm = f"{name}_w{w}" + (f"d{depth}" if depth else "") + ("t" if top else "")
        arms[arm] = lambda i, d=d, p=params: speculative_generate(
            target, d, p, prompts, lens, key(i), cfg, draft_len=a.k, engine=STATIC)
        if not a.no_adaptive:
          arms[f"{arm}_adaptive"] = lambda i, d=d, p=params, t=EngineTuning(): \
              speculative_generate(target, d, p, prompts, lens, key(i), cfg,
                                   draft_len=a.max_draft_len,
                                   engine=EngineConfig(compile=CompileConfig(ahead=True)), tuning=t)
      log(f"batch {batch}, {name}: {len(arms)} arms")
      timed = collections.defaultdict(list)  # every timed call's rollout (call 0 is untimed)

      def keep(fn, arm):
        def call(i):
          out = fn(i)
          if i > 0:
            timed[arm].append(out)
          return out
        return call

      arms = {n: keep(fn, n) for n, fn in arms.items()}
      for n, r in be.interleaved_runs(arms, a.repeats).items():
        runs[n] = be.arm_record(*r)
        runs[n]["all_segments"] = [s for out in timed[n] for s in out.segments]
        counts = [AcceptanceMetrics.from_counts(out.stats) for out in timed[n]]
        drafts = sum(m.num_drafts for m in counts)
        runs[n]["acceptance_length_all"] = sum(
            m.acceptance_length * m.num_drafts for m in counts if m.num_drafts) / max(drafts, 1)
      timed = None
      # the arms' programs go: one drafter's arms compile many (bucket, K, width) programs, and
      # several drafters' and batches' worth of them exhaust the process's memory maps
      arms = None
      jax.clear_caches()
    for rec in runs.values():  # every timed rollout's steps: their cost, yield, the trees
      segs = rec.pop("all_segments")
      steps = max(sum(g.iterations for g in segs), 1)
      rec["ms_per_step"] = 1e3 * sum(g.seconds for g in segs) / steps
      rec["tokens_per_step"] = sum(g.tokens for g in segs) / steps
      drafting = [g for g in segs if g.draft_len > 0]
      rec["tree_step_share"] = sum(g.iterations for g in drafting if g.tree_width > 1) / \
          max(sum(g.iterations for g in drafting), 1)
    for n, rec in runs.items():
      chain = runs[_chain_of(n)]
      rec["vs_chain_tokens_per_s"] = rec["tokens_per_s"] / chain["tokens_per_s"]
      rec["vs_chain_paired"] = be.paired_ratio(chain, rec) if rec is not chain else 1.0
      # tokens per second of stepping alone (every timed call's steps, no per-call costs)
      rec["vs_chain_per_step"] = (rec["tokens_per_step"] / rec["ms_per_step"]) / \
          (chain["tokens_per_step"] / chain["ms_per_step"])
      log(f"  {n:26s} {rec['tokens_per_s']:8.1f} tok/s  x{rec['vs_chain_tokens_per_s']:.2f} "
          f"of the chain  acc.len {rec['acceptance_length_all']:.2f}  K/bucket "
          f"{rec['k_per_bucket']}  tree steps {rec['tree_step_share']:.0%}")
    results[str(batch)] = runs
    write(a, summary_of(a, cfg_m, quantiles, results, t_start))  # each batch as it ends
  summary = summary_of(a, cfg_m, quantiles, results, t_start)
  print_table(summary)
  write(a, summary)
  log(f"wrote {a.out} ({summary['wall_s']:.0f} s)")
  return summary


def summary_of(a, cfg_m, quantiles, results: dict, t_start: float) -> dict:
  return {"machine": be.machine(), "command": "python experiments/bench_tree.py "
          + " ".join(sys.argv[1:]),
          "config": {"k": a.k, "max_draft_len": a.max_draft_len, "widths": a.widths,
                     "depths": a.depths, "chains": a.chains,
                     "batches": a.batches, "max_new": a.max_new,
                     "length_quantiles": quantiles, "drafters": a.drafters},
          "target_params": cfg_m.num_params(), "batches": results,
          "wall_s": time.perf_counter() - t_start}


def write(a, summary: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  tmp = a.out + ".tmp"
  with open(tmp, "w") as f:
    json.dump(summary, f, indent=1, default=float)
  os.replace(tmp, a.out)


def _chain_of(arm: str) -> str:
  """The chain arm (width 1) an arm is compared with: same drafter, same engine."""
  name, rest = arm.split("_w", 1)
  return f"{name}_w1" + rest[rest.index("_"):] if "_" in rest else f"{name}_w1"


def print_table(s: dict) -> None:
  print(f"\n{s['target_params'] / 1e6:.1f}M-parameter target, {s['machine']}")
  print("| batch | arm | tokens/s | x chain (tokens/s) | x chain (paired time) | "
        "x chain (per step) | acc. length | ms / step | tokens / step | K per bucket | "
        "tree steps |")
  print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
  for batch, runs in s["batches"].items():
    for n, r in runs.items():
      print(f"| {batch} | {n} | {r['tokens_per_s']:.1f} | {r['vs_chain_tokens_per_s']:.2f}x | "
            f"{r['vs_chain_paired']:.2f}x | {r['vs_chain_per_step']:.2f}x | "
            f"{r['acceptance_length_all']:.2f} | "
            f"{r['ms_per_step']:.2f} | {r['tokens_per_step']:.2f} | {r['k_per_bucket']} | "
            f"{r['tree_step_share']:.0%} |")


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
