"""Time to the first rollout: what a user waits before the engine's first `generate` /
`speculative_generate` call returns (prefill and segment programs compiled, step costs
calibrated, the rollout itself), at a real depth, in a fresh process per arm so nothing is
reused from another arm.

Arms (each: first call, then a second call with the same `EngineTuning`, which compiles and
calibrates nothing):
  ar           `generate` (the adaptive engine's defaults)
  spec         `speculative_generate` with an n-gram drafter (largest K `--draft-len`), defaults:
               a bucket's programs compile (K = 0 and the largest, two at a time) and are timed
               when the rollout first reaches it
  spec_ahead   the same with `EngineConfig(compile_ahead=True)`: every bucket's programs compile
               before the first segment (and a later rollout compiles nothing)
  spec_every_k the same as `spec`, timing every K at startup with 3 x 3 calibration steps
  spec_cached  `spec` in two fresh processes in turn that share a JAX persistent compilation
               cache and an engine cost cache (both in a temporary directory): `spec_cached_cold`
               compiles, calibrates and stores; `spec_cached_warm` is a second run of the same
               job, which loads its programs and reads its step costs. Their second calls
               compare steps of programs compiled in the process with steps of loaded ones.

The model is a random Qwen3-style decoder of the shape given (default: 0.47B parameters, 28
layers, hidden 1024, 16/8 heads of 128, MLP 3072, vocab 32768, tied embeddings), float32.
Compile seconds come from JAX's own compile-time events.

  python experiments/bench_first_rollout.py                 # 0.47B, 8 rows x 32 tokens
  python experiments/bench_first_rollout.py --quick         # 8 layers, hidden 512
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from bench_io import write_json
from specjax.jobs import run_main

ARMS = ("ar", "spec", "spec_ahead", "spec_every_k", "spec_cached")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="8 layers of hidden 512 (a smoke run)")
  p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
  p.add_argument("--layers", type=int, default=28)
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--mlp", type=int, default=3072)
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=24)
  p.add_argument("--max-new", type=int, default=32)
  p.add_argument("--draft-len", type=int, default=4)
  p.add_argument("--out", default="runs/bench_first_rollout.json")
  p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
  p.add_argument("--result", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.quick:
    a.layers, a.hidden, a.heads, a.kv_heads, a.head_dim, a.mlp = 8, 512, 8, 4, 64, 1536
  return a


def child(a: argparse.Namespace) -> dict:
  """One arm in this (fresh) process."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from specjax.drafters import NgramDrafter
  from specjax.models import Decoder, ModelConfig
  from specjax.sampling import EngineConfig, SamplingConfig, generate, speculative_generate
  from specjax.sampling.calibration import EngineTuning
  from specjax.sampling.engine import compiled_programs

  compile_s = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, secs, **kw: compile_s.append(secs)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  cfg = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                    num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                    mlp_hidden=a.mlp)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, a.vocab, (a.batch, a.prompt_len)), jnp.int32)
  lengths = jnp.full((a.batch,), a.prompt_len, jnp.int32)
  sampling = SamplingConfig(max_new_tokens=a.max_new, temperature=0.0)
  engine = EngineConfig()
  if a.child == "spec_ahead":
    engine = engine.replace(compile=dict(ahead=True))
  if a.child == "spec_every_k":
    engine = engine.replace(calibration=dict(every_k=True, iters=3, repeats=3))
  tuning = EngineTuning()
  if a.child == "spec_cached":  # the parent names the shared caches
    jax.config.update("jax_compilation_cache_dir", os.environ["BENCH_JAX_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    tuning = EngineTuning.with_cache(os.environ["BENCH_COST_CACHE"])

  def call(i: int):
    key = jax.random.key(i)
    if a.child == "ar":
      return generate(model, prompts, lengths, key, sampling, engine=engine, tuning=tuning)
    return speculative_generate(model, NgramDrafter(draft_len=a.draft_len, n=3), (), prompts,
                                lengths, key, sampling, engine=engine, tuning=tuning)

  times, compiles, programs = [], [], []
  for i in range(2):
    before_c, before_p = len(compile_s), compiled_programs()
    t0 = time.perf_counter()
    out = call(i)
    jax.block_until_ready(out.tokens)
    times.append(time.perf_counter() - t0)
    compiles.append(sum(compile_s[before_c:]))
    programs.append(compiled_programs() - before_p)
  return {"params": int(params), "first_call_s": times[0], "second_call_s": times[1],
          "compile_s": compiles[0], "second_compile_s": compiles[1],
          "programs_compiled": programs[0], "second_programs_compiled": programs[1],
          "timed_costs": sum(not r["from_line"] for r in tuning.calibration_table()),
          "segments": [(s.bucket, s.draft_len, s.iterations) for s in out.segments]}


def main(argv=None) -> None:
  a = parse_args(argv)
  if a.child:
    write_json(a.result, child(a))
    return
  shape = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "mlp",
                                      "vocab", "batch", "prompt_len", "max_new", "draft_len")}
  arms = {}
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, BENCH_JAX_CACHE=os.path.join(tmp, "jax_cache"),
               BENCH_COST_CACHE=os.path.join(tmp, "engine_costs.json"))
    for arm in a.arms:
      names = [f"{arm}_cold", f"{arm}_warm"] if arm == "spec_cached" else [arm]
      for name in names:
        result = os.path.join(tmp, f"{name}.json")
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
        cmd = [sys.executable, os.path.abspath(__file__), "--child", arm, "--result", result,
               *flags]
        print(f"[{name}] running ...", flush=True)
        subprocess.run(cmd, check=True, env=env)
        with open(result) as f:
          arms[name] = json.load(f)
  print(f"\n{'arm':>16} {'first s':>8} {'compile s':>10} {'programs':>9} {'timed':>6} "
        f"{'second s':>9} {'2nd programs':>13}")
  for arm, r in arms.items():
    print(f"{arm:>16} {r['first_call_s']:8.1f} {r['compile_s']:10.1f} {r['programs_compiled']:9d} "
          f"{r['timed_costs']:6d} {r['second_call_s']:9.2f} {r['second_programs_compiled']:13d}")
  if "spec" in arms and "spec_ahead" in arms:
    print(f"first speculative call, buckets compiled when reached / all compiled first: "
          f"{arms['spec']['first_call_s'] / arms['spec_ahead']['first_call_s']:.2f}x")
  if "spec" in arms and "spec_every_k" in arms:
    print(f"first speculative call, every K timed / defaults: "
          f"{arms['spec_every_k']['first_call_s'] / arms['spec']['first_call_s']:.2f}x")
  if "spec_cached_cold" in arms:
    cold, warm = arms["spec_cached_cold"], arms["spec_cached_warm"]
    print(f"second run of the job (programs and costs cached) / first: first call "
          f"{warm['first_call_s'] / cold['first_call_s']:.2f}x; second call (loaded programs / "
          f"compiled ones) {warm['second_call_s'] / cold['second_call_s']:.2f}x")
  import jax
  write_json(a.out, {"benchmark": "first_rollout", "shape": shape, "arms": arms,
                     "machine": {"cpu": platform.processor() or platform.machine(),
                                 "cores": os.cpu_count(), "jax": jax.__version__,
                                 "xla_flags": os.environ.get("XLA_FLAGS", "")}})
  print(f"wrote {a.out}")


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
