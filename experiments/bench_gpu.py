"""GPU benchmark in one command: the paged-attention kernel against its reference, AR decode
against the memory-read roof at Qwen3-1.7B and Qwen3-8B shapes (random weights, bfloat16) at batch
1/64/256, the speculative engine on a workload whose drafts are accepted, first-call (compile)
times and peak device memory; on request a GRPO-shaped queue (waves, continuous batching, paged
against dense KV memory at one budget). JSON out, written after every stage, so a run stopped at
its time limit keeps what it measured.

  python experiments/bench_gpu.py --out runs/bench_gpu.json      # H100: the stages end near 450 s
  python experiments/bench_gpu.py --stages queue --out runs/bench_gpu_queue.json  # the queue
  python experiments/bench_gpu.py --smoke                        # tiny shapes, any machine, seconds

Needs jax, flax, optax, numpy, safetensors, tokenizers, jinja2, tqdm (a GPU image's usual set);
nothing is downloaded. Run it from the repository root (it puts the root on sys.path).

What each figure is:
- paged: the Pallas paged-attention kernel (`paged_attention(implementation="pallas")`, compiled
  for the device; interpret mode where there is no GPU) against the plain-formula reference on
  pages with holes, out-of-order pages, a padding row and a stacked pool (max abs difference,
  float32 and bfloat16, one token and a verify block; and at every launch setting,
  --pages-per-block x --num-warps, on one of them); then milliseconds per call of the kernel (at
  its default launch setting and at every other), the reference and the chunked pure-JAX path
  (chunks forced: off the CPU its default is the reference) at Qwen3-8B attention heads over
  --paged-batch rows of ragged lengths up to --paged-context (GB/s: K and V bytes of the visible
  positions / time);
  then greedy `generate` on a small float32 model through the paged engine (the kernel inside
  every step) against the dense engine: rows whose tokens are identical.
- decode: `generate` with the plain loop (`STATIC`: one program per batch, full batch, whole
  cache) on prompts of --prompt-len tokens, --new-tokens sampled at temperature 1 with no EOS, so
  every row runs every step. The engine times its decode loop as one segment (no prefill): seconds
  per step = segment seconds / steps. The roof is the bytes a step must read (all weights + the
  KV cache it attends over) at the device's measured copy bandwidth; `roof_fraction` = roof step
  time / measured step time (above 1 where the step reads faster than a copy moves bytes:
  `achieved_gbps` against the device's nominal bandwidth is the other measure). `first_call_s`
  is the first call (compile + run), `call_s` the fastest of --repeats further calls (each in
  `calls_s`), whose segment gives the step.
- context: the decode step as in decode at --context-model over prompts of --context-len tokens
  (batches --context-batches), where the KV cache a step reads rivals the weights; with decode's
  rows these calibrate the simulator's H100 factors (`simulate.py --calibrate --bench-only`).
- reads: the plain loop's decode step (as in decode) at --reads-model and --reads-batches with
  the dense KV cache read whole (the default off the CPU) and read in chunks up to the live
  extent (the CPU default, forced, as the loop at every step: without the CPU's one-pass read
  of a step that reaches the last chunk, `cache.SUMS_MAX_QUERIES`): a chunked read is a loop of
  dynamic length, whose condition a GPU hands back to the host at every iteration. Beside each,
  the bare chain: one cached forward of every row over the full cache plus its argmax, 8 in a
  loop of fixed length (`specjax.sim.measure.time_forward`), so the step's cost beyond its
  forward shows.
- speculative: the target's layers from --draft-layers on have zero output projections (as a
  grown policy's new layers do), so a draft model made of its first --draft-layers layers
  computes the target's distribution exactly and drafts are accepted (acceptance length close to
  K + 1) while the target still reads all its weights every step. Arms: AR (`STATIC`), the
  speculative plain loop at K = --draft-len, the adaptive engine (K in 0..--draft-len per
  segment), and the plain loop verifying the same drafts as a draft tree of --tree-width (the
  chain plus each depth's next most likely draft tokens: 1 + K * W positions per verify; and,
  for each D in --tree-depths above 0, `spec_tree_d<D>_static` with alternatives at the first D
  depths only, 1 + K + D * (W - 1) positions; every chain accepted here, so their tokens/s
  against `spec_static` is the cost of the wider verify);
  tokens/s (of the fastest of --repeats calls after the first), step milliseconds and
  first-call seconds of each.
- queue (run it by name: `--stages queue`): a GRPO-shaped queue at --queue-model, the
  speculative stage's target (drafts accepted): --queue-prompts prompts x --queue-group samples
  at temperature 1, --queue-new-tokens at most, an EOS set of random token ids sized so that
  lengths are about geometric with mean a quarter of the maximum (long-tailed; the lengths
  reached are recorded). Arms: `waves` (batches of --queue-slots rows, one `generate` call each),
  `continuous` (one call, `EngineConfig(max_rows=--queue-slots)`), `continuous_spec` (the same
  with the draft model, adaptive K), and at one KV budget (what half the slots' dense caches
  take) `dense` (that many slots) against `paged` (`kv_cache_gb` = the budget, up to
  --queue-slots slots), `paged_spec` (paged with the draft model, whose cache takes pages of
  the same budget; adaptive K) and `paged_tuned` (paged with the kernel's launch setting that
  decoded fastest in the paged stage, run only after it); --queue-arms picks some: tokens/s
  (the fastest of --queue-repeats calls after the first), rows held (most live rows a segment
  started with, and the step-weighted mean), peak memory. Every
  arm compiles its buckets (at most --queue-buckets) before its first segment.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gc
import json
import os
import platform
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from specjax.drafters import DraftModelDrafter, truncated_copy  # noqa: E402
from specjax.jobs import run_main  # noqa: E402
from specjax.models import Decoder, ModelConfig  # noqa: E402
from specjax.models import cache, paged, paged_attention  # noqa: E402
from specjax.sampling import (STATIC, AcceptanceMetrics, EngineConfig,  # noqa: E402
                              EngineTuning, SamplingConfig, generate, speculative_generate)
from specjax.sampling.engine_config import (BucketConfig, CompileConfig, PagingConfig,  # noqa: E402
                                            QueueConfig)
from specjax.sim.measure import time_forward  # noqa: E402

SHAPES = {  # Qwen3 config.json values; random weights
    "qwen3-1.7b": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, mlp_hidden=6144, vocab_size=151936, tie_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, mlp_hidden=12288, vocab_size=151936, tie_embeddings=False),
    "smoke": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                  mlp_hidden=128, vocab_size=512, tie_embeddings=True),
}
NOMINAL_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "B200": 8000.0, "GB200": 8000.0}


QUEUE_ARMS = ("waves", "continuous", "continuous_spec", "dense", "paged", "paged_spec",
              "paged_tuned")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--models", nargs="+", default=["qwen3-1.7b", "qwen3-8b"], choices=list(SHAPES))
  p.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--spec-model", default="qwen3-1.7b", choices=list(SHAPES),
                 help="model of the speculative stage ('' skips it)")
  p.add_argument("--spec-batches", nargs="+", type=int, default=[1, 64])
  p.add_argument("--draft-len", type=int, default=4)
  p.add_argument("--draft-layers", type=int, default=2)
  p.add_argument("--tree-width", type=int, default=3,
                 help="speculative stage: also the plain loop verifying the drafts as a tree of "
                      "this width (1: no tree arm)")
  p.add_argument("--tree-depths", type=int, nargs="+", default=[0, 1],
                 help="speculative stage: a tree arm per depth D (alternatives at the first D "
                      "depths; 0: every depth)")
  p.add_argument("--stages", nargs="+", default=["paged", "decode", "context", "spec"],
                 help="stages to run, in this order: paged, decode (every --models shape), "
                      "decode=SHAPE (one shape), context, spec, reads")
  p.add_argument("--context-model", default="qwen3-1.7b", choices=list(SHAPES),
                 help="model of the context stage (decode over long prompts)")
  p.add_argument("--context-len", type=int, default=2048,
                 help="prompt tokens of the context stage")
  p.add_argument("--context-batches", nargs="+", type=int, default=[1, 64])
  p.add_argument("--reads-model", default="qwen3-1.7b", choices=list(SHAPES),
                 help="model of the reads stage (whole against chunked dense-cache reads)")
  p.add_argument("--reads-batches", nargs="+", type=int, default=[1, 64])
  p.add_argument("--reads-chunk", type=int, default=None,
                 help="cache positions per chunk of the chunked arm (default: the library's)")
  q = p.add_argument_group("queue stage")
  q.add_argument("--queue-model", default="qwen3-1.7b", choices=list(SHAPES))
  q.add_argument("--queue-prompts", type=int, default=64)
  q.add_argument("--queue-group", type=int, default=4, help="samples per prompt (GRPO's G)")
  q.add_argument("--queue-slots", type=int, default=64)
  q.add_argument("--queue-prompt-len", type=int, default=128)
  q.add_argument("--queue-new-tokens", type=int, default=1024)
  q.add_argument("--queue-buckets", type=int, default=3,
                 help="EngineConfig.buckets.max_buckets of every queue arm (compiled ahead)")
  q.add_argument("--queue-repeats", type=int, default=2)
  q.add_argument("--queue-arms", nargs="+", choices=QUEUE_ARMS, default=list(QUEUE_ARMS),
                 help="arms of the queue stage, in this order")
  p.add_argument("--pages-per-block", type=int, nargs="+", default=[1, 2, 4, 8],
                 help="paged stage: the kernel's pages per loop step to check and time")
  p.add_argument("--num-warps", type=int, nargs="+", default=[0, 8],
                 help="paged stage: the kernel's warps per program to check and time (0: "
                 "Triton's default)")
  p.add_argument("--num-splits", type=int, nargs="+", default=[1, 4],
                 help="paged stage: programs each row's pages are split over, to check and time "
                 "(1: no split)")
  p.add_argument("--paged-batch", type=int, default=64)
  p.add_argument("--paged-context", type=int, default=2048,
                 help="longest row of the paged-attention timing (rows are 1/4 to all of it)")
  p.add_argument("--budget-s", type=float, default=450.0,
                 help="stages that would start after this many seconds are skipped (logged)")
  p.add_argument("--repeats", type=int, default=3,
                 help="timed calls after the first of each decode and speculative arm (the "
                      "fastest is reported)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/bench_gpu.json")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes and batches (a check that the script runs, not a benchmark)")
  if "--smoke" in (sys.argv[1:] if argv is None else argv):  # other defaults; flags still apply
    p.set_defaults(models=["smoke"], spec_model="smoke", batches=[1, 4], spec_batches=[2],
                   draft_len=2, prompt_len=8, new_tokens=8, dtype="float32", paged_batch=2,
                   paged_context=64,
                   reads_model="smoke", reads_batches=[2], reads_chunk=4, repeats=2,
                   context_model="smoke", context_len=24, context_batches=[2],
                   queue_model="smoke", queue_prompts=6, queue_group=2, queue_slots=4,
                   queue_prompt_len=8, queue_new_tokens=64, queue_repeats=1, queue_buckets=1,
                   pages_per_block=[1, 4], num_warps=[0],
                   stages=["paged", "decode", "context", "spec", "reads", "queue"])
  a = p.parse_args(argv)
  for name in ("prompt_len", "new_tokens", "draft_len", "draft_layers", "tree_width",
               "paged_batch",
               "paged_context", "repeats", "context_len", "queue_prompts", "queue_group",
               "queue_slots", "queue_prompt_len", "queue_new_tokens", "queue_buckets",
               "queue_repeats"):
    if getattr(a, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
  for stage in a.stages:
    name, _, shape = stage.partition("=")
    if name not in ("paged", "decode", "context", "spec", "reads", "queue") or (
        shape and (name != "decode" or shape not in SHAPES)):
      p.error(f"--stages: {stage!r} is not paged, decode, decode=SHAPE (one of "
              f"{', '.join(SHAPES)}), context, spec, reads or queue")
  if a.queue_slots % a.queue_group or a.queue_slots < 2 * a.queue_group:
    p.error(f"--queue-slots ({a.queue_slots}) must be a multiple of --queue-group "
            f"({a.queue_group}) holding at least two groups")
  if any(b < 1 for b in a.batches + a.spec_batches + a.reads_batches + a.context_batches):
    p.error("batches must be >= 1")
  if any(n < 1 or n & (n - 1) for n in a.pages_per_block):
    p.error(f"--pages-per-block must be powers of two >= 1, got {a.pages_per_block}")
  if any(n < 0 for n in a.num_warps):
    p.error(f"--num-warps must be >= 0 (0: Triton's default), got {a.num_warps}")
  if any(n < 1 for n in a.num_splits):
    p.error(f"--num-splits must be >= 1, got {a.num_splits}")
  if any(d < 0 for d in a.tree_depths):
    p.error(f"--tree-depths must be >= 0 (0: every depth), got {a.tree_depths}")
  return a


def log(msg: str) -> None:
  print(f"[{time.perf_counter() - START:7.1f}s] {msg}", flush=True)


START = time.perf_counter()


def device_info() -> dict:
  d = jax.devices()[0]
  kind = getattr(d, "device_kind", str(d))
  nominal = next((v for k, v in NOMINAL_GBPS.items() if k in kind), None)
  return {"platform": d.platform, "device_kind": kind, "device_count": jax.device_count(),
          "nominal_gbps": nominal, "jax": jax.__version__,
          "host": f"{platform.machine()} {os.cpu_count()} cpus"}


def copy_bandwidth_gbps(mbytes: int) -> float:
  """GB/s of a device-to-device copy (bytes read + written), the best of 5."""
  x = jnp.ones((mbytes * (1 << 20) // 4,), jnp.float32)
  copy = jax.jit(lambda v: v + 1.0)
  jax.block_until_ready(copy(x))
  best = float("inf")
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(copy(x))
    best = min(best, time.perf_counter() - t0)
  return 2 * x.nbytes / best / 1e9


def peak_memory_gb() -> float | None:
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else peak / 1e9


def build_target(shape: str, dtype: str, draft_layers: int, seed: int) -> Decoder:
  """Random weights; layers >= draft_layers get zero attention-output and MLP-down projections
  (each such layer is the identity on the residual stream, yet reads all its weights)."""
  cfg = ModelConfig(**SHAPES[shape], dtype=dtype, param_dtype=dtype, init_std=0.02)
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  for i in range(draft_layers, cfg.num_layers):
    layer = model.layers[i]
    layer.attn.o_proj[...] = jnp.zeros_like(layer.attn.o_proj[...])
    layer.mlp.down[...] = jnp.zeros_like(layer.mlp.down[...])
  return model


def step_bytes(model: Decoder, batch: int, cache_size: int) -> float:
  """Bytes one decode step reads: every weight, plus the K and V of every cached position."""
  cfg = model.cfg
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  itemsize = jnp.dtype(cfg.dtype).itemsize
  kv = batch * cache_size * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
  return float(weights + kv)


def prompts_for(batch: int, width: int, vocab: int, seed: int):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, (batch, width)).astype(np.int32)
  return jnp.asarray(tokens), jnp.full((batch,), width, jnp.int32)


def timed_calls(fn, repeats: int):
  """(first call seconds, fastest of `repeats` further calls in seconds, that call's output (a
  rollout, or a list of them), every further call's seconds): one call alone has been seen to run
  at half speed."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(0))
  first = time.perf_counter() - t0
  calls, best = [], None
  for i in range(1, 1 + max(repeats, 1)):
    t0 = time.perf_counter()
    out = fn(i)
    jax.block_until_ready(out)
    calls.append(time.perf_counter() - t0)
    if best is None or calls[-1] < best[0]:
      best = (calls[-1], out)
  return first, best[0], best[1], calls


def decode_row(a, model, graphdef, params, b: int, bandwidth: float,
               prompt_len: int | None = None, temperature: float = 1.0) -> dict:
  """One batch of the plain loop: step time from the timed decode segment, against the roof
  (`temperature` 0: greedy, as a peer's greedy decode is timed)."""
  prompt_len = prompt_len or a.prompt_len
  scfg = SamplingConfig(max_new_tokens=a.new_tokens, temperature=temperature)
  prompts, lengths = prompts_for(b, prompt_len, model.cfg.vocab_size, a.seed + b)
  run = lambda i: generate((graphdef, params), prompts, lengths, jax.random.key(i), scfg,
                           engine=STATIC)
  try:
    first, call, out, calls = timed_calls(run, a.repeats)
  except Exception as e:  # e.g. out of memory at the largest batch: keep the other rows
    return {"batch": b, "error": f"{type(e).__name__}: {str(e)[:500]}"}
  seg = out.segments[0]
  step_s = seg.seconds / max(seg.iterations, 1)
  nbytes = step_bytes(model, b, prompt_len + a.new_tokens)
  roof_s = nbytes / (bandwidth * 1e9)
  flops = 2.0 * model.cfg.num_params() * b
  return {"batch": b, "prompt_len": prompt_len, "context_len": prompt_len + a.new_tokens / 2,
          "first_call_s": first, "call_s": call, "calls_s": calls, "steps": seg.iterations,
          "step_ms": 1e3 * step_s, "tokens_per_s": b / step_s, "fixed_s": call - seg.seconds,
          "step_gbytes": nbytes / 1e9, "roof_step_ms": 1e3 * roof_s,
          "roof_fraction": roof_s / step_s, "achieved_gbps": nbytes / step_s / 1e9,
          "achieved_tflops": flops / step_s / 1e12, "peak_memory_gb": peak_memory_gb()}


def log_row(label: str, row: dict) -> None:
  if "error" in row:
    log(f"{label}: failed ({row['error'][:200]})")
    return
  log(f"{label}: {row['step_ms']:8.2f} ms/step  {row['tokens_per_s']:9.0f} tok/s  "
      f"roof {row['roof_step_ms']:7.2f} ms ({100 * row['roof_fraction']:5.1f}%)  "
      f"{row['achieved_gbps']:6.0f} GB/s  "
      f"{row['achieved_tflops']:6.1f} TFLOP/s  first call {row['first_call_s']:6.1f} s")


def decode_stage(a, shape: str, bandwidth: float, results: dict) -> None:
  t0 = time.perf_counter()
  model = build_target(shape, a.dtype, a.draft_layers, a.seed)
  graphdef, params = nnx.split(model)
  log(f"{shape}: {model.cfg.num_params() / 1e9:.2f}B parameters built in "
      f"{time.perf_counter() - t0:.1f} s")
  rows = []
  for b in a.batches:
    if over_budget(a, f"{shape} decode batch {b}", results):
      break
    rows.append(decode_row(a, model, graphdef, params, b, bandwidth))
    log_row(f"{shape} batch {b:4d}", rows[-1])
    results.setdefault("decode", {})[shape] = rows
    write(a, results)
  results.setdefault("decode", {})[shape] = rows
  write(a, results)
  model = graphdef = params = None
  gc.collect()


def context_stage(a, bandwidth: float, results: dict) -> None:
  """The plain loop's decode step at --context-model over prompts of --context-len tokens: the
  KV cache read per step is then as large as the weights or larger."""
  shape = a.context_model
  model = build_target(shape, a.dtype, a.draft_layers, a.seed)
  graphdef, params = nnx.split(model)
  rows = []
  for b in a.context_batches:
    if over_budget(a, f"{shape} context {a.context_len} batch {b}", results):
      break
    rows.append(decode_row(a, model, graphdef, params, b, bandwidth, a.context_len))
    log_row(f"{shape} batch {b:4d} prompt {a.context_len}", rows[-1])
    results["context"] = {shape: rows}
    write(a, results)
  model = graphdef = params = None
  gc.collect()


def attention_loops(model: Decoder, batch: int, size: int) -> bool:
  """Whether one cached forward over a full `size`-position cache reads it in a loop (chunks),
  with the cache constants as they are now."""
  graphdef, params = nnx.split(model)
  kv = model.init_cache(batch, size).with_lengths(jnp.full((batch,), size - 1, jnp.int32))
  forward = lambda p, kv: nnx.merge(graphdef, p)(jnp.ones((batch, 1), jnp.int32), cache=kv).logits
  return "while" in str(jax.make_jaxpr(forward)(params, kv))


def reads_stage(a, bandwidth: float, results: dict) -> None:
  """The plain loop's step with the dense cache read whole (the default off the CPU) against
  read in chunks up to the live extent (the CPU default, forced here), at --reads-model."""
  shape = a.reads_model
  model = build_target(shape, a.dtype, a.draft_layers, a.seed)
  graphdef, params = nnx.split(model)
  names = ("CHUNKED_READ_BACKENDS", "CACHE_CHUNK_MIN_BYTES", "CACHE_CHUNK", "SUMS_MAX_QUERIES")
  saved = tuple(getattr(cache, n) for n in names)
  chunk = a.reads_chunk or saved[2]
  # chunked: the loop at every step (the CPU's one-pass multiply-and-sum is not what is measured)
  modes = {"whole": ((), *saved[1:]), "chunked": ((jax.default_backend(),), 0, chunk, 0)}
  size = a.prompt_len + a.new_tokens
  rows = []
  try:
    for b in a.reads_batches:
      if over_budget(a, f"reads batch {b}", results):
        break
      row = {"batch": b}
      for mode, values in modes.items():
        for n, value in zip(names, values):
          setattr(cache, n, value)
        jax.clear_caches()  # the constants are read at trace time
        row[mode] = decode_row(a, model, graphdef, params, b, bandwidth)
        row[mode]["attention_loops"] = attention_loops(model, b, size)
        log_row(f"{shape} batch {b:4d} cache read {mode:7s}", row[mode])
        if "step_ms" in row[mode]:  # the bare chain: cached forwards + argmax in a fixed loop
          forward_s, _ = time_forward(model, b, 1, size)
          row[mode]["forward_ms"] = 1e3 * forward_s
          log(f"{shape} batch {b:4d} cache read {mode:7s}: bare forward {1e3 * forward_s:8.2f} "
              f"ms (the engine's step is {row[mode]['step_ms'] / (1e3 * forward_s):.2f}x it)")
      if "step_ms" in row["whole"] and "step_ms" in row["chunked"]:
        row["chunked_over_whole"] = row["chunked"]["step_ms"] / row["whole"]["step_ms"]
      rows.append(row)
      results["reads"] = {"model": shape, "cache_chunk": chunk, "rows": rows}
      write(a, results)
  finally:
    for n, value in zip(names, saved):
      setattr(cache, n, value)
    jax.clear_caches()
  model = graphdef = params = None
  gc.collect()


def spec_stage(a, results: dict) -> None:
  shape = a.spec_model
  model = build_target(shape, a.dtype, a.draft_layers, a.seed)
  draft, dparams = DraftModelDrafter.from_model(truncated_copy(model, a.draft_layers), a.draft_len)
  scfg = SamplingConfig(max_new_tokens=a.new_tokens, temperature=1.0)
  out_rows = []
  for b in a.spec_batches:
    prompts, lengths = prompts_for(b, a.prompt_len, model.cfg.vocab_size, a.seed + 1000 + b)
    tuning = EngineTuning()
    arms = {
        "ar": lambda i: generate(model, prompts, lengths, jax.random.key(i), scfg, engine=STATIC),
        "spec_static": lambda i: speculative_generate(model, draft, dparams, prompts, lengths,
                                                      jax.random.key(i), scfg, engine=STATIC),
        "spec_adaptive": lambda i: speculative_generate(
            model, draft, dparams, prompts, lengths, jax.random.key(i), scfg,
            engine=EngineConfig(buckets=BucketConfig(max_buckets=1)), tuning=tuning),
    }
    for depth in a.tree_depths if a.tree_width > 1 else ():
      # the same drafts verified as a tree: what its wider verify costs
      tree = dataclasses.replace(draft, tree_width=a.tree_width, tree_depth=depth)
      arms[f"spec_tree{f'_d{depth}' if depth else ''}_static"] = \
          lambda i, tree=tree: speculative_generate(model, tree, dparams, prompts, lengths,
                                                    jax.random.key(i), scfg, engine=STATIC)
    row = {"batch": b, "draft_len": a.draft_len, "draft_layers": a.draft_layers, "arms": {}}
    for name, fn in arms.items():
      if over_budget(a, f"speculative {name} batch {b}", results):
        break
      try:
        first, call, out, calls = timed_calls(fn, a.repeats)
      except Exception as e:  # e.g. out of memory: keep the other arms and stages
        row["arms"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        log(f"spec {shape} batch {b:3d} {name}: failed ({row['arms'][name]['error'][:200]})")
        continue
      tokens = int(np.asarray(out.lengths).sum())
      rec = {"first_call_s": first, "call_s": call, "calls_s": calls, "tokens_per_s": tokens / call,
             "forward_steps": int(out.num_steps), "peak_memory_gb": peak_memory_gb()}
      if out.stats is not None:
        m = AcceptanceMetrics.from_counts(out.stats)
        rec["acceptance_length"] = m.acceptance_length if m.num_drafts else None
        rec["k_per_segment"] = [s.draft_len for s in out.segments]
        steps = sum(s.iterations for s in out.segments)
        rec["step_ms"] = 1e3 * sum(s.seconds for s in out.segments) / max(steps, 1)
      if "tokens_per_s" in row["arms"].get("ar", {}):
        rec["speedup_vs_ar"] = rec["tokens_per_s"] / row["arms"]["ar"]["tokens_per_s"]
      row["arms"][name] = rec
      log(f"spec {shape} batch {b:3d} {name:13s}: {rec['tokens_per_s']:9.0f} tok/s  first call "
          f"{first:6.1f} s  acc.len {rec.get('acceptance_length') or 1.0:.2f}  "
          f"x{rec.get('speedup_vs_ar', 1.0):.2f} of AR")
      results["speculative"] = {"model": shape, "rows": out_rows + [row]}
      write(a, results)
    out_rows.append(row)
  results["speculative"] = {"model": shape, "rows": out_rows}
  write(a, results)


def queue_stage(a, results: dict) -> None:
  model = build_target(a.queue_model, a.dtype, a.draft_layers, a.seed)
  draft, dparams = DraftModelDrafter.from_model(truncated_copy(model, a.draft_layers), a.draft_len)
  cfg = model.cfg
  rng = np.random.default_rng(a.seed + 7)
  # an EOS set of random ids: under a near-uniform next-token distribution a row ends at each
  # step with probability |EOS| / V, so its length is about geometric with mean max_new / 4
  n_eos = max(1, round(cfg.vocab_size * 4 / a.queue_new_tokens))
  eos = tuple(int(t) for t in rng.choice(np.arange(1, cfg.vocab_size), n_eos, replace=False))
  scfg = SamplingConfig(max_new_tokens=a.queue_new_tokens, temperature=1.0, eos_ids=eos)
  distinct, _ = prompts_for(a.queue_prompts, a.queue_prompt_len, cfg.vocab_size, a.seed + 2000)
  prompts = jnp.repeat(distinct, a.queue_group, axis=0)
  rows, slots = prompts.shape[0], a.queue_slots
  lengths = jnp.full((rows,), a.queue_prompt_len, jnp.int32)
  # one KV budget: what half the slots' dense caches take (prompt + max_new positions each)
  budget_rows = max(slots // 2 // a.queue_group, 1) * a.queue_group
  itemsize = jnp.dtype(cfg.dtype).itemsize
  token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
  budget_gb = budget_rows * (a.queue_prompt_len + a.queue_new_tokens) * token_bytes / 2**30
  queue_engine = EngineConfig(buckets=BucketConfig(max_buckets=a.queue_buckets),
                              compile=CompileConfig(ahead=True))

  def engine(max_rows: int = 0, **paging) -> EngineConfig:
    return queue_engine.replace(queue=dict(max_rows=max_rows), paging=paging)

  # each arm keeps its engine tuning across its calls, as an RL run does across its rollouts:
  # the first call compiles and times the step and refill costs, the timed calls reuse them
  tunings = collections.defaultdict(EngineTuning)

  def waves(i):
    outs = [generate(model, prompts[w:w + slots], lengths[w:w + slots],
                     jax.random.fold_in(jax.random.key(i), w), scfg, engine=engine(),
                     tuning=tunings["waves"])
            for w in range(0, rows, slots)]
    return outs

  arms = {
      "waves": waves,
      "continuous": lambda i: [generate(model, prompts, lengths, jax.random.key(i), scfg,
                                        engine=engine(max_rows=slots),
                                        tuning=tunings["continuous"])],
      "continuous_spec": lambda i: [speculative_generate(
          model, draft, dparams, prompts, lengths, jax.random.key(i), scfg,
          engine=engine(max_rows=slots), tuning=tunings["continuous_spec"])],
      "dense": lambda i: [generate(model, prompts, lengths, jax.random.key(i), scfg,
                                   engine=engine(max_rows=budget_rows), tuning=tunings["dense"])],
      "paged": lambda i: [generate(model, prompts, lengths, jax.random.key(i), scfg,
                                   engine=engine(max_rows=slots, kv_cache_gb=budget_gb),
                                   tuning=tunings["paged"])],
      "paged_spec": lambda i: [speculative_generate(
          model, draft, dparams, prompts, lengths, jax.random.key(i), scfg,
          engine=engine(max_rows=slots, kv_cache_gb=budget_gb), tuning=tunings["paged_spec"])],
  }
  # paged with the kernel's launch setting that decoded fastest in this run's paged stage
  tuned = fastest_launch(results)
  if tuned is not None:
    arms["paged_tuned"] = lambda i: [generate(
        model, prompts, lengths, jax.random.key(i), scfg,
        engine=engine(max_rows=slots, kv_cache_gb=budget_gb, kernel_pages=tuned[0],
                      kernel_warps=tuned[1], kernel_splits=tuned[2]),
        tuning=tunings["paged_tuned"])]
  elif "paged_tuned" in a.queue_arms:
    log("queue paged_tuned: skipped (no paged stage ran before the queue)")
  arms = {name: arms[name] for name in a.queue_arms if name in arms}
  stage = {"model": a.queue_model, "rows": rows, "slots": slots, "group": a.queue_group,
           "prompt_len": a.queue_prompt_len, "max_new_tokens": a.queue_new_tokens,
           "eos_ids": len(eos), "kv_budget_gb": budget_gb, "kv_budget_dense_rows": budget_rows,
           "arms": {}}
  results["queue"] = stage
  for name, fn in arms.items():
    if over_budget(a, f"queue {name}", results):
      break
    try:
      first, call, outs, calls = timed_calls(fn, a.queue_repeats)
    except Exception as e:  # e.g. out of memory: keep the other arms
      stage["arms"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
      log(f"queue {name}: failed ({stage['arms'][name]['error'][:200]})")
      write(a, results)
      continue
    lens = np.concatenate([np.asarray(o.lengths) for o in outs])
    segs = [s for o in outs for s in o.segments]
    steps = sum(s.iterations for s in segs)
    rec = {"first_call_s": first, "call_s": call, "calls_s": calls,
           "tokens": int(lens.sum()), "tokens_per_s": float(lens.sum()) / call,
           "length_quantiles": [float(np.quantile(lens, q)) for q in (0.1, 0.5, 0.9)],
           "length_max": int(lens.max()), "segments": len(segs), "steps": steps,
           "rows_max": max(s.live_rows_start for s in segs),
           "rows_mean": sum(s.live_rows_start * s.iterations for s in segs) / max(steps, 1),
           # where the timed call went: the segments' steps (each segment's own time, its
           # host round trip included) against the rest (prefills, admissions, harvests,
           # compaction, the host between segments)
           "segments_s": sum(s.seconds for s in segs),
           "outside_segments_s": call - sum(s.seconds for s in segs),
           "refills": sum(1 for s in segs if s.refill_at),
           "refill_at": {str(f): sum(1 for s in segs if s.refill_at == f)
                         for f in sorted({s.refill_at for s in segs if s.refill_at})},
           "peak_memory_gb": peak_memory_gb()}
    if name in ("continuous_spec", "paged_spec"):
      m = AcceptanceMetrics.from_counts(outs[0].stats)
      rec["acceptance_length"] = m.acceptance_length if m.num_drafts else None
      rec["steps_by_k"] = {}
      for sg in segs:
        rec["steps_by_k"][str(sg.draft_len)] = rec["steps_by_k"].get(str(sg.draft_len), 0) + \
            sg.iterations
    if name == "paged_tuned":
      rec["kernel_pages"], rec["kernel_warps"], rec["kernel_splits"] = tuned
    if name in ("paged", "paged_spec", "paged_tuned"):
      rec["pages_in_use_max"] = max(s.pages_in_use for s in segs)
      rec["swapped_out"] = sum(s.swapped_out for s in segs)
    stage["arms"][name] = rec
    base = stage["arms"].get("waves", {}).get("tokens_per_s")
    vs = f"  x{rec['tokens_per_s'] / base:.2f} of waves" if base else ""
    log(f"queue {a.queue_model} {name:15s}: {rec['tokens_per_s']:9.0f} tok/s  first call "
        f"{first:6.1f} s  {1e3 * rec['segments_s'] / max(steps, 1):.2f} ms/step in segments, "
        f"{rec['outside_segments_s']:.3f} s outside ({rec['refills']} refills)  "
        f"rows {rec['rows_max']} max / {rec['rows_mean']:.1f} mean  lengths "
        f"p10/p50/p90 {'/'.join(f'{x:.0f}' for x in rec['length_quantiles'])}{vs}")
    write(a, results)
  model = draft = dparams = None
  gc.collect()


def default_launch() -> tuple[int, int, int]:
  """The kernel's default launch setting as (pages per loop step, warps, splits; 0: default)."""
  return (paged_attention.PAGES_PER_BLOCK, paged_attention.NUM_WARPS or 0,
          paged_attention.NUM_SPLITS or 0)


def launch_name(launch: tuple[int, int, int]) -> str:
  per, warps, splits = launch
  return f"pallas_p{per}_w{warps or 'default'}_s{splits or 'auto'}"


def fastest_launch(results: dict) -> tuple[int, int, int] | None:
  """(pages per loop step, warps, splits; 0: the default) of the kernel's fastest decode (one
  query per row) in this run's paged stage; None when it did not run."""
  rows = [r for r in results.get("paged", {}).get("timings", []) if r["tokens"] == 1]
  name = rows[0].get("fastest_pallas") if rows else None
  if name is None:
    return None
  if name == "pallas":
    return default_launch()
  pages, warps, splits = re.fullmatch(r"pallas_p(\d+)_w(\w+)_s(\w+)", name).groups()
  return (int(pages), 0 if warps == "default" else int(warps),
          0 if splits == "auto" else int(splits))


PAGE_SIZE = 16
ENGINE_CHECK_SHAPE = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                          head_dim=128, mlp_hidden=1024, vocab_size=4096, tie_embeddings=True)


def paged_problem(rng, batch: int, t: int, heads: int, kv_heads: int, dh: int,
                  lengths: np.ndarray, layers: int = 0):
  """q, pools and a page table: each row's pages distinct and in random order in the pool, the
  rest of the pool (and, with `layers`, the other layers of a stacked pool) random noise; the
  queries are the row's last t positions."""
  width = -(-int(lengths.max()) // PAGE_SIZE)
  num_pages = batch * width + 3
  table = rng.permutation(num_pages)[:batch * width].reshape(batch, width).astype(np.int32)
  pool_shape = ((layers,) if layers else ()) + (kv_heads, num_pages, PAGE_SIZE, dh)
  q = rng.normal(size=(batch, t, heads, dh)).astype(np.float32)
  pool_k = rng.normal(size=pool_shape).astype(np.float32)
  pool_v = rng.normal(size=pool_shape).astype(np.float32)
  lengths = lengths.astype(np.int32)
  return q, pool_k, pool_v, table, lengths, (lengths - t).astype(np.int32)


def paged_stage(a, results: dict) -> None:
  interpret = jax.default_backend() != "gpu"  # the kernel is compiled for GPUs only
  heads = SHAPES["smoke" if a.smoke else "qwen3-8b"]
  h, hkv, dh = heads["num_heads"], heads["num_kv_heads"], heads["head_dim"]
  res = results.setdefault("paged", {"interpret": interpret, "page_size": PAGE_SIZE})
  cpu = jax.devices("cpu")[0]

  def kernel(*args, **kw):
    return paged_attention.paged_attention(*args, implementation="pallas", interpret=interpret,
                                           **kw)

  # 1. the kernel against the reference (run on the host CPU in float32) on awkward page tables
  checks = []
  rng = np.random.default_rng(a.seed)
  for t in (1, a.draft_len + 1):
    for dtype in ("float32", "bfloat16"):
      for layers in (0, 3):
        lengths = rng.integers(t, 6 * PAGE_SIZE, size=4)
        q, pk, pv, table, lengths, start = paged_problem(rng, 4, t, h, hkv, dh, lengths, layers)
        table[0, 0] = paged.NO_PAGE  # a hole: the first query positions see no key there
        table[1, :2] = table[1, 1::-1].copy()  # two pages swapped
        table[2] = paged.NO_PAGE  # a padding row (stale length): sees nothing, returns 0
        kw = {"layer": jnp.int32(1)} if layers else {}
        with jax.default_device(cpu):
          want = np.asarray(paged_attention.paged_attention_reference(
              q, pk, pv, table, lengths, start, **kw))
        cast = lambda x: jnp.asarray(x, dtype)
        rec = {"tokens": t, "dtype": dtype, "stacked": bool(layers)}
        try:
          got = jax.jit(kernel)(cast(q), cast(pk), cast(pv), jnp.asarray(table),
                                jnp.asarray(lengths), jnp.asarray(start), **kw)
          got = np.asarray(got.astype(jnp.float32))
          rec.update(max_abs_err=float(np.abs(got - want).max()),
                     max_abs_ref=float(np.abs(want).max()),
                     padding_row_zero=bool((got[2] == 0).all()))
        except Exception as e:  # record the failure; the other checks and stages still run
          rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
        checks.append(rec)
        log(f"paged kernel check T={t} {dtype:8s} {'stacked' if layers else 'one layer'}: " +
            (rec["error"][:300] if "error" in rec else
             f"max |kernel - reference| {rec['max_abs_err']:.2e} (|ref| <= "
             f"{rec['max_abs_ref']:.2f}), padding row zero {rec['padding_row_zero']}"))
  res["checks"] = checks
  # each launch setting of the kernel (pages per loop step, warps, splits of a row's pages) on
  # one awkward problem too
  launches = [(per, warps, splits) for per in a.pages_per_block for warps in a.num_warps
              for splits in a.num_splits]
  lengths = rng.integers(a.draft_len + 1, 6 * PAGE_SIZE, size=4)
  q, pk, pv, table, lengths, start = paged_problem(rng, 4, a.draft_len + 1, h, hkv, dh, lengths, 3)
  table[0, 0], table[2] = paged.NO_PAGE, paged.NO_PAGE
  with jax.default_device(cpu):
    want = np.asarray(paged_attention.paged_attention_reference(q, pk, pv, table, lengths, start,
                                                      layer=jnp.int32(1)))
  res["launch_checks"] = []
  for per, warps, splits in launches:
    rec = {"pages_per_block": per, "num_warps": warps or None, "num_splits": splits}
    try:
      got = jax.jit(functools.partial(kernel, layer=jnp.int32(1), pages_per_block=per,
                                      num_warps=warps or None, num_splits=splits))(
          *(jnp.asarray(x, jnp.bfloat16) for x in (q, pk, pv)), jnp.asarray(table),
          jnp.asarray(lengths), jnp.asarray(start))
      rec["max_abs_err"] = float(np.abs(np.asarray(got.astype(jnp.float32)) - want).max())
    except Exception as e:
      rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
    res["launch_checks"].append(rec)
    log(f"paged kernel check, {per} pages per step, warps {warps or 'default'}, {splits} "
        f"split(s): " +
        (rec["error"][:300] if "error" in rec else f"max |kernel - reference| "
         f"{rec['max_abs_err']:.2e} (bfloat16)"))
  write(a, results)

  # 2. milliseconds per call at decode and verify shapes over ragged rows
  timings = []
  impls = ("pallas", "reference", "chunked")
  for t in (1, a.draft_len + 1):
    lengths = rng.integers(a.paged_context // 4, a.paged_context + 1, size=a.paged_batch)
    lengths = np.maximum(lengths, t)
    q, pk, pv, table, lengths, start = paged_problem(rng, a.paged_batch, t, h, hkv, dh, lengths)
    args = [jnp.asarray(x, a.dtype) for x in (q, pk, pv)] + [jnp.asarray(table),
                                                             jnp.asarray(lengths),
                                                             jnp.asarray(start)]
    itemsize = jnp.dtype(a.dtype).itemsize
    kv_bytes = float(lengths.sum()) * hkv * dh * 2 * itemsize
    row = {"tokens": t, "batch": a.paged_batch, "max_len": int(lengths.max()),
           "mean_len": float(lengths.mean()), "kv_gbytes": kv_bytes / 1e9, "dtype": a.dtype}
    variants = [(impl, None) for impl in impls] + [
        ("pallas", launch) for launch in launches
        if launch != default_launch()]
    for impl, launch in variants:
      fn = jax.jit(kernel if impl == "pallas" and launch is None else
                   functools.partial(kernel, pages_per_block=launch[0],
                                     num_warps=launch[1] or None,
                                     num_splits=launch[2] or None) if impl == "pallas" else
                   paged_attention.paged_attention_reference if impl == "reference" else
                   functools.partial(paged_attention.paged_attention_chunked, min_bytes=0))
      if launch is not None:  # a launch setting other than the default's
        impl = launch_name(launch)
      try:
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(10):
          t0 = time.perf_counter()
          jax.block_until_ready(fn(*args))
          times.append(time.perf_counter() - t0)
        best = min(times)
        row[impl] = {"ms": 1e3 * best, "median_ms": 1e3 * float(np.median(times)),
                     "gbps": kv_bytes / best / 1e9}
        log(f"paged attention T={t} batch {a.paged_batch} (rows up to {row['max_len']}) "
            f"{impl:9s}: {1e3 * best:8.3f} ms  {kv_bytes / best / 1e9:7.1f} GB/s of K and V")
      except Exception as e:
        row[impl] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
        log(f"paged attention T={t} {impl}: failed ({row[impl]['error'][:300]})")
    kernels = {k: v["ms"] for k, v in row.items() if k.startswith("pallas") and "ms" in v}
    if kernels:
      row["fastest_pallas"] = min(kernels, key=kernels.get)
    timings.append(row)
    res["timings"] = timings
    write(a, results)

  # 3. the paged engine (the kernel in every step) against the dense engine, greedy
  shape = SHAPES["smoke"] if a.smoke else ENGINE_CHECK_SHAPE
  cfg = ModelConfig(**shape, dtype="float32", param_dtype="float32")
  model = Decoder(cfg, rngs=nnx.Rngs(a.seed))
  rows, slots = 16, 8
  prompts, lengths = prompts_for(rows, 24, cfg.vocab_size, a.seed + 7)
  lengths = jnp.asarray(np.random.default_rng(a.seed).integers(8, 25, rows), jnp.int32)
  scfg = SamplingConfig(max_new_tokens=64, temperature=0.0)
  token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
  paging = PagingConfig(page_size=PAGE_SIZE,
                        kv_cache_gb=2 * slots * (24 + 64) * token_bytes / 2**30)
  engines = {"dense": EngineConfig(queue=QueueConfig(max_rows=slots)),
             "paged": EngineConfig(queue=QueueConfig(max_rows=slots), paging=paging)}
  outs, rec = {}, {"rows": rows, "slots": slots, "model": shape}
  try:
    with jax.default_matmul_precision("highest"):  # no TF32: the two paths differ in attention only
      for name, engine in engines.items():
        first, call, outs[name], _ = timed_calls(
            lambda i, engine=engine: generate(model, prompts, lengths, jax.random.key(i), scfg,
                                              engine=engine), 1)
        rec[name] = {"first_call_s": first, "call_s": call}
    d, p = (np.asarray(outs[k].tokens) for k in ("dense", "paged"))
    n = np.asarray(outs["dense"].lengths)
    same = [bool(np.array_equal(d[r, :n[r]], p[r, :n[r]]))
            and int(outs["paged"].lengths[r]) == int(n[r]) for r in range(rows)]
    rec["rows_identical"] = int(sum(same))
  except Exception as e:
    rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
  res["engine_greedy"] = rec
  log("paged engine vs dense engine, greedy: " + (rec["error"][:300] if "error" in rec else
      f"{rec['rows_identical']}/{rows} rows identical (paged first call "
      f"{rec['paged']['first_call_s']:.1f} s)"))
  write(a, results)


def over_budget(a, stage: str, results: dict) -> bool:
  elapsed = time.perf_counter() - START
  if elapsed <= a.budget_s:
    return False
  log(f"skipped {stage}: {elapsed:.0f} s elapsed > --budget-s {a.budget_s:.0f}")
  results.setdefault("skipped", []).append(stage)
  return True


def write(a, results: dict) -> None:
  results["elapsed_s"] = time.perf_counter() - START
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  tmp = f"{a.out}.tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=1)
  os.replace(tmp, a.out)


def main(argv=None) -> dict:
  global START
  a = parse_args(argv)
  START = time.perf_counter()  # the clock of log, over_budget and write: this run's, not the import's
  results = {"device": device_info(), "args": vars(a),
             "command": "python experiments/bench_gpu.py " +
                        " ".join(sys.argv[1:] if argv is None else argv)}
  log(f"device: {results['device']}")
  bandwidth = copy_bandwidth_gbps(64 if a.smoke else 1024)
  results["device"]["copy_gbps"] = bandwidth
  log(f"device copy bandwidth {bandwidth:.0f} GB/s (read + write; nominal "
      f"{results['device']['nominal_gbps']})")
  write(a, results)
  for stage in a.stages:
    if stage == "paged" and not over_budget(a, "paged", results):
      paged_stage(a, results)
    name, _, one = stage.partition("=")
    if name == "decode":
      for shape in [one] if one else a.models:
        if not over_budget(a, f"{shape} decode", results):
          decode_stage(a, shape, bandwidth, results)
    if stage == "context" and not over_budget(a, "context", results):
      context_stage(a, bandwidth, results)
    if stage == "spec" and a.spec_model and not over_budget(a, "speculative", results):
      spec_stage(a, results)
    if stage == "reads" and not over_budget(a, "reads", results):
      reads_stage(a, bandwidth, results)
    if stage == "queue" and not over_budget(a, "queue", results):
      queue_stage(a, results)
  log(f"done: {a.out}")
  return results


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
