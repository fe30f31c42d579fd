"""Timing probes for calibrating the simulator on this machine: cached target forwards of T tokens
per row at batch b over a cache window W (the engine's primitive cost), written as JSON.

The only module of specjax.sim that imports jax; `import specjax.sim` never loads it.
"""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models import Decoder, ModelConfig

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


def time_forward(model: Decoder, batch: int, tokens: int, window: int, repeats: int = 5) -> float:
  """Median seconds of one cached forward of `tokens` tokens per row over a `window`-position
  cache (rows filled to window - tokens), logits and a greedy pick included, measured as
  ITERS forwards in one jitted loop so that Python dispatch is not counted."""
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
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(run(params, cache, toks))
    times.append((time.perf_counter() - t0) / ITERS)
  return statistics.median(times)


def forward_grid(cfg: ModelConfig, batches, tokens, windows, repeats: int = 5,
                 seed: int = 0) -> list[dict]:
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  rows = []
  for b, t, w in itertools.product(batches, tokens, windows):
    s = time_forward(model, b, t, w, repeats)
    rows.append({"batch": b, "tokens": t, "window": w, "seconds": s})
    print(f"  b={b:<4} T={t:<3} W={w:<5} {s * 1e3:8.3f} ms", flush=True)
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
    print(f"{name}: {cfg.num_params() / 1e6:.2f}M params", flush=True)
    out["models"][name] = {"model": model_fields(cfg), "num_params": cfg.num_params(),
                           "rows": forward_grid(cfg, batches, tokens, windows, repeats)}
  return out
