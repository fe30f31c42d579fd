"""Timing probes for calibrating the simulator on this machine: cached target forwards of T tokens
per row at batch b over a cache window W (the engine's primitive cost), written as JSON.

The only module of specjax.sim that imports jax; `import specjax.sim` never loads it.
"""

from __future__ import annotations

import itertools
import logging
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models import Decoder, ModelConfig
from specjax.sim.engine_model import ARMS

log = logging.getLogger(__name__)
ITERS = 8  # forwards per timed call, inside one jitted loop (as in the engine's while_loop)


def model_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                 dtype: str = "float32") -> ModelConfig:
  return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, mlp_hidden=3 * hidden, dtype=dtype,
                     param_dtype=dtype)


def model_fields(cfg: ModelConfig) -> dict:
  """The ModelSpec fields (specjax.sim.catalog) of a specjax decoder config."""
  nbytes = 2 if cfg.dtype == "bfloat16" else 4
  return {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads,
          "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate": cfg.mlp_hidden,
          "vocab": cfg.vocab_size, "tie_embeddings": bool(cfg.tie_embeddings),
          "bytes_per_param": nbytes, "kv_bytes": nbytes}


def _timed(fn, repeats: int) -> tuple[list[float], list[float], object]:
  """Wall and process-CPU seconds of `repeats` calls. On a shared machine wall time swings
  with the other jobs' load (3x here); the CPU time this process used barely moves (+-10%).
  Also returns the last call's output."""
  wall, cpu, out = [], [], None
  for _ in range(repeats):
    w0, c0 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn())
    wall.append(time.perf_counter() - w0)
    cpu.append(time.process_time() - c0)
  return wall, cpu, out


def time_forward(model: Decoder, batch: int, tokens: int, window: int,
                 repeats: int = 5) -> tuple[float, float]:
  """Median (wall, CPU) seconds of one cached forward of `tokens` tokens per row over a
  `window`-position cache (rows filled to window - tokens), logits and a greedy pick included,
  measured as ITERS forwards in one jitted loop so that Python dispatch is not counted."""
  graphdef, params = nnx.split(model)
  cache = model.init_cache(batch, window).with_lengths(
      jnp.full((batch,), window - tokens, jnp.int32))

  @jax.jit
  def run(params, cache, toks):
    m = nnx.merge(graphdef, params)

    def body(_, carry):
      toks, cache = carry
      out = m(toks, cache=cache)  # the cache is carried, as in the engine, so writes are in place
      return jnp.argmax(out.logits, -1).astype(jnp.int32), out.cache
    return jax.lax.fori_loop(0, ITERS, body, (toks, cache))[0]

  toks = jnp.ones((batch, tokens), jnp.int32)
  jax.block_until_ready(run(params, cache, toks))
  wall, cpu, _ = _timed(lambda: run(params, cache, toks), repeats)
  return statistics.median(wall) / ITERS, statistics.median(cpu) / ITERS


def forward_grid(cfg: ModelConfig, batches, tokens, windows, repeats: int = 5,
                 seed: int = 0) -> list[dict]:
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  rows = []
  for b, t, w in itertools.product(batches, tokens, windows):
    s, c = time_forward(model, b, t, w, repeats)
    rows.append({"batch": b, "tokens": t, "window": w, "seconds": s, "seconds_cpu": c})
    log.info("  b=%-4d T=%-3d W=%-5d %8.3f ms (cpu %8.3f ms)", b, t, w, s * 1e3, c * 1e3)
  return rows


def machine() -> str:
  return (f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__}, "
          f"backend {jax.default_backend()}")


# Probe models (random weights, float32), named by their shapes. "fit" models calibrate the
# per-machine factors; "heldout" ones (other widths, depths, vocabularies) only validate them.
PROBE_MODELS = {
    "d128-l4-v256": dict(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, vocab=256),
    "d256-l4-v512": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, vocab=512),
    "d256-l8-v512": dict(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, vocab=512),
    "d512-l4-v1024": dict(hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, vocab=1024),
}


def run_probes(names, batches=(1, 4, 16, 64), tokens=(1, 4, 8), windows=(128, 512),
               repeats: int = 5) -> dict:
  """Forward grids of the named PROBE_MODELS, as the JSON that calibrate loads
  ({"kind": "forward_costs", "machine", "models": {name: {"model": fields, "rows": [...]}}})."""
  out = {"kind": "forward_costs", "machine": machine(), "iters_per_call": ITERS, "models": {}}
  for name in names:
    cfg = model_config(**PROBE_MODELS[name])
    log.info("%s: %.2fM params", name, cfg.num_params() / 1e6)
    out["models"][name] = {"model": model_fields(cfg), "num_params": cfg.num_params(),
                           "rows": forward_grid(cfg, batches, tokens, windows, repeats)}
  return out


def time_engine_arms(cfg: ModelConfig, *, batch: int, prompt_len: int, max_new: int,
                     eos_tokens: int, draft_len: int = 3, max_draft_len: int = 3,
                     draft_layers: int = 1, min_bucket: int = 8, repeats: int = 3,
                     temperature: float = 1.0, init_std: float = 0.05, seed: int = 0,
                     arms=ARMS) -> dict:
  """Rollouts of one random-weight target by specjax's engine in each arm, as the bench_engine
  JSON schema (docs/SIMULATOR.md) plus per-arm `lengths`, `rollout_s_min` and `rollout_s_all`.
  Tokens 1..eos_tokens end a row, so completion lengths are long-tailed (about geometric,
  mean vocab / eos_tokens, clipped at max_new). The draft is the target's first
  `draft_layers` layers (shared embedding and head). All arms share one `EngineTuning`: its
  measured costs and acceptance estimates carry from arm to arm, and its calibration table is
  the JSON's."""
  import numpy as np

  from specjax.sampling import (STATIC, AcceptanceMetrics, EngineConfig, EngineTuning,
                                SamplingConfig, generate, speculative_generate)
  from specjax.sampling.engine_config import AdaptiveConfig, BucketConfig
  from specjax.drafters import DraftModelDrafter, DraftModelMethod, truncated_copy

  cfg = cfg.replace(init_std=init_std)
  target = Decoder(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  lengths = rng.integers(max(prompt_len // 2, 1), prompt_len + 1, batch).astype(np.int32)
  prompts = rng.integers(eos_tokens + 1, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
  prompts = np.where(np.arange(prompt_len)[None] < lengths[:, None], prompts, 0)
  prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
  scfg = SamplingConfig(max_new_tokens=max_new, temperature=temperature,
                        eos_ids=tuple(range(1, eos_tokens + 1)))
  drafter, dparams = DraftModelDrafter.from_model(truncated_copy(target, draft_layers), draft_len)
  engines = {"static": STATIC,
             "compact": EngineConfig(buckets=BucketConfig(min_bucket=min_bucket),
                                     adaptive=AdaptiveConfig(enabled=False)),
             "adaptive": EngineConfig(buckets=BucketConfig(min_bucket=min_bucket),
                                      adaptive=AdaptiveConfig(enabled=True,
                                                              max_draft_len=max_draft_len))}
  key = jax.random.key(seed)
  out_arms = {}
  tuning = EngineTuning()
  for arm in arms:
    kind, mode = arm.split("_")
    if kind == "ar":
      run = lambda: generate(target, prompts, lengths, key, scfg, engine=engines[mode],
                             tuning=tuning)
    else:
      run = lambda: speculative_generate(target, drafter, dparams, prompts, lengths, key, scfg,
                                         engine=engines[mode], tuning=tuning)
    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    first = time.perf_counter() - t0
    times, cpu, out = _timed(run, repeats)
    acc = 1.0
    rates = []
    if out.stats is not None:
      m = AcceptanceMetrics.from_counts(out.stats)
      acc, rates = float(m.acceptance_length), [float(x) for x in
                                                m.per_position_acceptance_rate]
    segs = [{"bucket": s.bucket, "draft_len": s.draft_len, "window": s.window,
             "iterations": s.iterations, "live_rows_start": s.live_rows_start,
             "seconds": s.seconds, "tokens": s.tokens} for s in out.segments]
    kpb = {}
    for s in segs:
      kpb[str(s["bucket"])] = s["draft_len"]
    out_arms[arm] = {"rollout_s": statistics.median(times), "rollout_s_min": min(times),
                     "rollout_s_all": times, "rollout_cpu_s": statistics.median(cpu),
                     "rollout_cpu_s_all": cpu, "first_call_s": first,
                     "acceptance_length": acc, "per_position_acceptance_rate": rates,
                     "tokens": int(np.sum(out.lengths)), "k_per_bucket": kpb,
                     "segments": segs, "lengths": [int(x) for x in np.asarray(out.lengths)]}
    log.info("  %-14s %7.3f s (min %.3f, cpu %.3f, first %.1f)  acc %.2f  segments %d  K %s",
             arm, statistics.median(times), min(times), statistics.median(cpu), first, acc,
             len(segs), kpb)
  fields = model_fields(cfg)
  ref = out_arms.get("ar_static") or next(iter(out_arms.values()))
  return {"machine": machine(), "command": "", "config": {
      "hidden": fields["hidden"], "layers": fields["layers"], "heads": fields["heads"],
      "kv_heads": fields["kv_heads"], "head_dim": fields["head_dim"], "vocab": fields["vocab"],
      "batch": batch, "max_new": max_new, "prompt_len": prompt_len,
      "temperature": temperature, "max_draft_len": max_draft_len,
      "length_quantiles": sorted(ref["lengths"]), "draft_layers": draft_layers,
      "min_bucket": min_bucket, "eos_tokens": eos_tokens, "draft_len": draft_len},
      "target_params": cfg.num_params(),
      "calibration": {"rows": tuning.calibration_table(), "drafter": DraftModelMethod.name},
      "arms": out_arms}
