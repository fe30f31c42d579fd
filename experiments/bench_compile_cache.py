"""Do programs loaded from JAX's persistent compilation cache run as fast as freshly compiled ones?

The experiment jobs keep XLA's compiled programs in `<cache_dir>/xla`, so a second run loads them
instead of compiling. This times both kinds of executable of the same program side by side in one
process: a first process compiles the programs into a temporary cache directory (the job's first
run); a second process (the job's second run) loads them from that directory and also compiles
them afresh (against an empty directory), then calls the two executables in alternation,
`--rounds` times each (the order flips every round). Programs, at the model shape given (default:
the bench_queue target, 8 layers of hidden 512):
  decode  16 decode steps of the decoder over a dense KV cache (a `fori_loop`), --batch rows
  train   gradient of the token log-likelihood of --train-batch x --seq tokens (forward +
          backward, the train step's heaviest part)
Reported per program: compile seconds (loading / compiling), call ms (median and best of each)
and the median over rounds of the paired ratio loaded / fresh. Prints a table, writes JSON.

  python experiments/bench_compile_cache.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from bench_io import write_json
from specjax.jobs import run_main


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--vocab", type=int, default=512)
  p.add_argument("--batch", type=int, default=16, help="decode rows")
  p.add_argument("--cache", type=int, default=288, help="decode KV cache positions")
  p.add_argument("--train-batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--rounds", type=int, default=20)
  p.add_argument("--out", default="runs/bench_compile_cache.json")
  p.add_argument("--child", choices=("store", "compare"), help=argparse.SUPPRESS)
  p.add_argument("--cache-dir", help=argparse.SUPPRESS)
  p.add_argument("--result", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def programs(a):
  """{name: (function, arguments)} at `a`'s shape."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from specjax.models import Decoder, ModelConfig
  from specjax.models.chunked import token_logprobs

  cfg = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                    num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                    mlp_hidden=3 * a.hidden)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)

  def decode(params, cache, tokens):
    def step(i, carry):
      cache, tokens = carry
      out = nnx.merge(graphdef, params)(tokens, cache=cache)
      nxt = jnp.argmax(out.logits[:, -1], -1)[:, None].astype(jnp.int32)
      return out.cache.advance(jnp.ones_like(cache.lengths)), nxt
    return jax.lax.fori_loop(0, 16, step, (cache, tokens))

  def loss(params, tokens):
    m = nnx.merge(graphdef, params)
    h = m.final_norm(m(tokens, compute_logits=False).hidden)
    lp, _ = token_logprobs(h[:, :-1], m.head_weight(), tokens[:, 1:], chunk=128)
    return -jnp.mean(lp)

  cache = model.init_cache(a.batch, a.cache).with_lengths(
      jnp.full((a.batch,), a.cache - 40, jnp.int32))
  tokens = jax.random.randint(jax.random.key(0), (a.train_batch, a.seq), 0, a.vocab)
  return {"decode": (decode, (params, cache, jnp.zeros((a.batch, 1), jnp.int32))),
          "train": (jax.grad(loss), (params, tokens))}


def compiled(fn, args, name: str, cache_dir: str) -> tuple[object, float]:
  """(executable, seconds) of `fn` compiled with the persistent cache at `cache_dir`."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  jax.config.update("jax_compilation_cache_dir", cache_dir)
  compilation_cache.reset_cache()
  wrapper = lambda *xs: fn(*xs)
  wrapper.__name__ = name  # one module name per program, whichever process compiles it
  t0 = time.perf_counter()
  exe = jax.jit(wrapper).lower(*args).compile()
  return exe, time.perf_counter() - t0


def child(a) -> dict:
  import jax

  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  out = {}
  for name, (fn, args) in programs(a).items():
    loaded, load_s = compiled(fn, args, name, a.cache_dir)
    if a.child == "store":
      out[name] = {"compile_s": load_s}
      continue
    with tempfile.TemporaryDirectory() as empty:
      fresh, fresh_s = compiled(fn, args, name, empty)
    exes = {"loaded": loaded, "fresh": fresh}
    for exe in exes.values():
      jax.block_until_ready(exe(*args))
    times = {"loaded": [], "fresh": []}
    for r in range(a.rounds):
      for kind in (("loaded", "fresh") if r % 2 == 0 else ("fresh", "loaded")):
        t0 = time.perf_counter()
        jax.block_until_ready(exes[kind](*args))
        times[kind].append(time.perf_counter() - t0)
    out[name] = {"load_s": load_s, "compile_s": fresh_s,
                 "loaded_ms": [1e3 * t for t in times["loaded"]],
                 "fresh_ms": [1e3 * t for t in times["fresh"]],
                 "paired_ratio": statistics.median(
                     [x / y for x, y in zip(times["loaded"], times["fresh"])])}
  return out


def main(argv=None) -> dict:
  a = parse_args(argv)
  if a.child:
    write_json(a.result, child(a))
    return {}
  flags = [f"--{k.replace('_', '-')}={getattr(a, k)}"
           for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "batch",
                     "cache", "train_batch", "seq", "rounds")]
  with tempfile.TemporaryDirectory() as tmp:
    res = {}
    for stage in ("store", "compare"):
      result = os.path.join(tmp, f"{stage}.json")
      print(f"[{stage}] running ...", flush=True)
      subprocess.run([sys.executable, os.path.abspath(__file__), "--child", stage,
                      "--cache-dir", os.path.join(tmp, "xla"), "--result", result, *flags],
                     check=True)
      with open(result) as f:
        res[stage] = json.load(f)
  rows = {}
  print(f"\n{'program':>8} {'compile s':>10} {'load s':>7} {'fresh ms (median/best)':>23} "
        f"{'loaded ms (median/best)':>24} {'loaded / fresh':>15}")
  for name, r in res["compare"].items():
    rows[name] = {"compile_s_first_run": res["store"][name]["compile_s"], **r}
    f, l_ = r["fresh_ms"], r["loaded_ms"]
    print(f"{name:>8} {r['compile_s']:10.2f} {r['load_s']:7.2f} "
          f"{statistics.median(f):14.1f} / {min(f):6.1f} {statistics.median(l_):15.1f} / "
          f"{min(l_):6.1f} {r['paired_ratio']:15.3f}")
  import jax
  summary = {"benchmark": "compile_cache", "rounds": a.rounds, "programs": rows,
             "shape": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "kv_heads",
                                                  "head_dim", "vocab", "batch", "cache",
                                                  "train_batch", "seq")},
             "machine": {"cpu": platform.processor() or platform.machine(),
                         "cores": os.cpu_count(), "jax": jax.__version__}}
  write_json(a.out, summary)
  print(f"wrote {a.out}")
  return summary


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
