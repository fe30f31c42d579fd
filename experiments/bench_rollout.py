"""Rollout benchmark: AR sampling vs speculative decoding (each drafter, each draft length K).

  python experiments/bench_rollout.py --hidden 128 --layers 4 --vocab 256 --batch 8 \
      --prompt-len 64 --max-new 64 --drafters ngram group_ngram draft_model \
      --draft-lens 1 2 3 5 7 --draft-layers 1 --out runs/bench_rollout.json

Random weights: the draft model is by default a truncated copy of the target (its first
--draft-layers layers + shared embedding and head) so that acceptance means something; prompts
repeat a phrase per prompt group so that n-gram lookup has something to find. Every method runs
once to compile (reported separately), then --repeats timed runs (median). Prints a table and
writes JSON (compatible with `specjax.sim.bench_data.cases_from_benchmark_json`). No assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from specjax.models import Decoder, ModelConfig  # noqa: E402
from specjax.drafters import (DraftModelDrafter, GroupNgramDrafter, NgramDrafter,  # noqa: E402
                              truncated_copy)
from specjax.jobs import run_main  # noqa: E402
from specjax.sampling import (AcceptanceMetrics, EngineTuning, SamplingConfig,  # noqa: E402
                              generate, speculative_generate)

DRAFTERS = ("ngram", "group_ngram", "draft_model")
SIM_DRAFTER = {"ar": "none", "ngram": "ngram", "group_ngram": "ngram", "draft_model": "draft-model"}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  m = p.add_argument_group("target model (random weights)")
  m.add_argument("--hidden", type=int, default=128)
  m.add_argument("--layers", type=int, default=4)
  m.add_argument("--heads", type=int, default=4)
  m.add_argument("--kv-heads", type=int, default=2)
  m.add_argument("--head-dim", type=int, default=32)
  m.add_argument("--mlp", type=int, default=None, help="MLP width (default 3 * hidden)")
  m.add_argument("--vocab", type=int, default=256)
  m.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  m.add_argument("--init-std", type=float, default=0.02)
  w = p.add_argument_group("workload")
  w.add_argument("--batch", type=int, default=8)
  w.add_argument("--prompt-len", type=int, default=64, help="padded width; rows are ragged")
  w.add_argument("--max-new", type=int, default=64)
  w.add_argument("--temperature", type=float, default=1.0)
  w.add_argument("--top-k", type=int, default=None)
  w.add_argument("--top-p", type=float, default=None)
  w.add_argument("--prompts", choices=("repeat", "random"), default="repeat",
                 help="repeat: each prompt group tiles a random phrase (n-gram friendly)")
  w.add_argument("--phrase-len", type=int, default=8)
  d = p.add_argument_group("drafters")
  d.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=list(DRAFTERS))
  d.add_argument("--draft-lens", nargs="+", type=int, default=[1, 2, 3, 5, 7])
  d.add_argument("--ngram-n", type=int, default=3)
  d.add_argument("--group-size", type=int, default=4, help="rows per prompt (GRPO G)")
  d.add_argument("--draft-from-target", action=argparse.BooleanOptionalAction, default=True,
                 help="draft = first --draft-layers layers of the target; else a random model")
  d.add_argument("--draft-layers", type=int, default=1)
  d.add_argument("--draft-hidden", type=int, default=64, help="random draft model only")
  d.add_argument("--draft-heads", type=int, default=2, help="random draft model only")
  r = p.add_argument_group("run")
  r.add_argument("--repeats", type=int, default=3)
  r.add_argument("--seed", type=int, default=0)
  r.add_argument("--forward-costs", action=argparse.BooleanOptionalAction, default=True,
                 help="also time one target forward of K+1 tokens vs 1 against the cache")
  r.add_argument("--hardware", default="cpu", help="name recorded in the JSON (sim catalog)")
  r.add_argument("--out", default=None, help="JSON output path")
  return p.parse_args(argv)


def model_config(a) -> ModelConfig:
  return ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                     num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                     mlp_hidden=a.mlp or 3 * a.hidden, dtype=a.dtype, param_dtype=a.dtype,
                     init_std=a.init_std)


def make_prompts(a, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded prompts [B, P] with ragged lengths in [P/2, P]; rows of a group share one."""
  groups = -(-a.batch // a.group_size)
  lengths = rng.integers(max(a.prompt_len // 2, 1), a.prompt_len + 1, groups)
  prompts = np.zeros((groups, a.prompt_len), np.int32)
  for g in range(groups):
    if a.prompts == "repeat":
      phrase = rng.integers(1, a.vocab, a.phrase_len)
      row = np.tile(phrase, -(-a.prompt_len // a.phrase_len))[:a.prompt_len]
    else:
      row = rng.integers(1, a.vocab, a.prompt_len)
    prompts[g, :lengths[g]] = row[:lengths[g]]
  rows = np.arange(a.batch) // a.group_size
  return prompts[rows], lengths[rows].astype(np.int32)


def make_drafter(a, name: str, k: int, target: Decoder, cfg: ModelConfig):
  if name == "ngram":
    return NgramDrafter(k, n=a.ngram_n), ()
  if name == "group_ngram":
    return GroupNgramDrafter(k, n=a.ngram_n, group_size=a.group_size), ()
  if a.draft_from_target:
    draft = truncated_copy(target, a.draft_layers)
  else:
    dcfg = cfg.replace(hidden_size=a.draft_hidden, num_layers=a.draft_layers,
                       num_heads=a.draft_heads, num_kv_heads=1, mlp_hidden=3 * a.draft_hidden)
    draft = Decoder(dcfg, rngs=nnx.Rngs(a.seed + 1))
  return DraftModelDrafter.from_model(draft, k)


def timed(fn, repeats: int):
  """(first call seconds, median of `repeats` later calls, last output)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return first, statistics.median(times), out


def forward_costs(a, target: Decoder, ks, context: int) -> dict[int, float]:
  """Seconds of one cached target forward of T = 1 and T = K+1 tokens at `context` entries."""
  graphdef, params = nnx.split(target)

  @jax.jit
  def fwd(params, cache, tokens):
    return nnx.merge(graphdef, params)(tokens, cache=cache).logits

  cache = target.init_cache(a.batch, context + max(ks) + 2).with_lengths(
      jnp.full((a.batch,), context, jnp.int32))
  out = {}
  for t in sorted({1} | {k + 1 for k in ks}):
    tokens = jnp.ones((a.batch, t), jnp.int32)
    out[t] = timed(lambda: fwd(params, cache, tokens), max(a.repeats, 5))[1]
  return out


def main(argv=None) -> dict:
  a = parse_args(argv)
  cfg = model_config(a)
  target = Decoder(cfg, rngs=nnx.Rngs(a.seed))
  prompts, lengths = make_prompts(a, np.random.default_rng(a.seed))
  prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
  scfg = SamplingConfig(max_new_tokens=a.max_new, temperature=a.temperature, top_k=a.top_k,
                        top_p=a.top_p)
  key = jax.random.key(a.seed)
  context = float(np.mean(lengths)) + a.max_new / 2
  results = []

  def record(method, k, first, run_s, out):
    tokens = int(np.sum(out.lengths))
    steps = int(out.num_steps)
    row = {"method": method, "drafter": SIM_DRAFTER[method], "draft_len": k, "batch": a.batch,
           "context_len": context, "tokens": tokens, "seconds": run_s,
           "compile_s": max(first - run_s, 0.0), "tokens_per_s": tokens / run_s,
           "steps": steps, "step_s": run_s / max(steps, 1), "acceptance_length": 1.0}
    if out.stats is not None:
      m = AcceptanceMetrics.from_counts(out.stats)
      row.update(acceptance_length=m.acceptance_length, acceptance_rate=m.acceptance_rate,
                 per_position_acceptance_rate=list(m.per_position_acceptance_rate))
      if a.temperature == 0:
        row["matches_ar"] = bool(np.array_equal(out.tokens, results[0]["_tokens"]))
    row["_tokens"] = np.asarray(out.tokens)
    results.append(row)
    print(f"  {method:<12} K={k:<2} {row['tokens_per_s']:9.1f} tok/s  "
          f"compile {row['compile_s']:5.1f}s  acc_len {row['acceptance_length']:.2f}", flush=True)

  print(f"target {cfg.num_params() / 1e6:.2f}M params, batch {a.batch}, prompt {a.prompt_len}, "
        f"max_new {a.max_new}, T={a.temperature}, backend {jax.default_backend()}", flush=True)
  record("ar", 0, *timed(lambda: generate(target, prompts, lengths, key, scfg), a.repeats))
  for name in a.drafters:
    for k in a.draft_lens:
      drafter, dparams = make_drafter(a, name, k, target, cfg)
      tuning = EngineTuning()  # calibrated in the untimed first run, reused by the timed ones
      run = lambda: speculative_generate(target, drafter, dparams, prompts, lengths, key, scfg,
                                         tuning=tuning)
      record(name, k, *timed(run, a.repeats))

  ar_tps = results[0]["tokens_per_s"]
  for r in results:
    r["speedup"] = r["tokens_per_s"] / ar_tps
    r.pop("_tokens")
  print_table(results)
  report = {
      "hardware": a.hardware,
      "machine": f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__}, "
                 f"backend {jax.default_backend()}",
      "model": {"name": "random", "hidden": cfg.hidden_size, "layers": cfg.num_layers,
                "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "intermediate": cfg.mlp_hidden, "vocab": cfg.vocab_size,
                "tie_embeddings": cfg.tie_embeddings,
                "bytes_per_param": 2 if a.dtype == "bfloat16" else 4,
                "kv_bytes": 2 if a.dtype == "bfloat16" else 4},
      "num_params": cfg.num_params(), "args": vars(a), "results": results}
  if a.forward_costs:
    costs = forward_costs(a, target, a.draft_lens, int(context))
    report["forward_costs"] = {str(t): s for t, s in costs.items()}
    print("target forward vs T=1 at context %d: " % context + ", ".join(
        f"T={t}: {s / costs[1]:.2f}x" for t, s in costs.items()))
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
      json.dump(report, f, indent=1)
    print(f"wrote {a.out}")
  return report


def print_table(results) -> None:
  head = (f"| {'method':<12} | {'K':>2} | {'tokens/s':>9} | {'speedup':>7} | {'acc. length':>11} "
          f"| {'acc. rate':>9} | {'steps':>5} | {'compile s':>9} |")
  print(head)
  print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
  for r in results:
    rate = r.get("acceptance_rate")
    print(f"| {r['method']:<12} | {r['draft_len'] or '-':>2} | {r['tokens_per_s']:9.1f} | "
          f"{r['speedup']:6.2f}x | {r['acceptance_length']:11.2f} | "
          f"{'-' if rate is None else f'{rate:.2f}':>9} | {r['steps']:5d} | "
          f"{r['compile_s']:9.1f} |")


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
