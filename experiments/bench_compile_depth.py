"""Compile time of the unrolled decoder against depth, and what a scan over layers would trade.

The decoder's layers are a Python loop, so XLA sees every layer. Default: forward + backward of a
token-logprob loss at 8, 16 and 36 layers (tiny widths: compile time depends on the graph, not
the sizes).

`--decode`: the rollout's decode step at a real shape (default 28 layers of the 0.47B Qwen3
shape: hidden 1024, 16/8 heads of 128, MLP 3072; a dense KV cache of 64 positions), two arms:
  unrolled  the decoder's own forward (`Decoder.__call__` with a `KVCache`), as the engine runs it
  scan      the same layers' parameters stacked on a leading axis and the cache too, one
            `lax.scan` over layers: XLA compiles one layer whatever the depth
Each arm: compile seconds of a program of 4 decode steps (a `fori_loop`), and ms per step from
programs of 4 and 20 steps (best of 3 each; the difference removes the per-call cost), at
batches 1 and 8.

  python experiments/bench_compile_depth.py --layers 8 16 36
  python experiments/bench_compile_depth.py --decode
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.jobs import run_main
from specjax.models import Decoder, ModelConfig
from specjax.models.chunked import token_logprobs


def compile_seconds(cfg: ModelConfig, seq: int, chunk: int) -> dict[str, float]:
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  tokens = jnp.zeros((1, seq), jnp.int32)

  def loss(state, tokens):
    m = nnx.merge(graphdef, state)
    out = m(tokens, compute_logits=False)
    h = m.final_norm(out.hidden)
    lp, _ = token_logprobs(h[:, :-1], m.embed[...].T, tokens[:, 1:], chunk=chunk)
    return -jnp.mean(lp)

  out = {}
  for name, fn in (("train", jax.grad(loss)), ("logprob", loss)):
    lowered = jax.jit(fn).lower(state, tokens)
    t0 = time.perf_counter()
    lowered.compile()
    out[name] = time.perf_counter() - t0
  return out


def decode_arms(cfg: ModelConfig, batches: list[int], cache: int) -> list[dict]:
  """Compile seconds and ms per decode step, unrolled (the decoder's forward) against a scan over
  stacked layers."""
  from specjax.models.layers import causal_mask

  model = Decoder(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  layer_def, _ = nnx.split(model.layers[0])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                         *[nnx.split(layer)[1] for layer in model.layers])

  def unrolled(n, state, tokens):
    m = nnx.merge(graphdef, state)
    kv = m.init_cache(tokens.shape[0], cache).with_lengths(
        jnp.full((tokens.shape[0],), 8, jnp.int32))

    def step(i, carry):
      tokens, kv = carry
      out = m(tokens, cache=kv)
      nxt = jnp.argmax(out.logits[:, -1], -1)[:, None].astype(jnp.int32)
      return nxt, out.cache.advance(jnp.ones((tokens.shape[0],), jnp.int32))

    return jax.lax.fori_loop(0, n, step, (tokens, kv))[0]

  def scanned(n, state, stacked, tokens):
    m = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    ks = jnp.zeros((cfg.num_layers, b, cfg.num_kv_heads, cfg.head_dim, cache), cfg.compute_dtype)
    vs = jnp.zeros((cfg.num_layers, b, cfg.num_kv_heads, cache, cfg.head_dim), cfg.compute_dtype)
    lengths = jnp.full((b,), 8, jnp.int32)

    def step(i, carry):
      tokens, ks, vs, lengths = carry
      pos = lengths[:, None]
      mask = causal_mask(pos, jnp.broadcast_to(jnp.arange(cache, dtype=jnp.int32), (b, cache)))

      def body(c, layer_state):
        x, ks, vs, j = c
        k = jax.lax.dynamic_index_in_dim(ks, j, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(vs, j, keepdims=False)
        x, (k, v) = nnx.merge(layer_def, layer_state)(x, pos, mask, (k, v), lengths, None)
        ks = jax.lax.dynamic_update_index_in_dim(ks, k, j, 0)
        vs = jax.lax.dynamic_update_index_in_dim(vs, v, j, 0)
        return (x, ks, vs, j + 1), None

      (x, ks, vs, _), _ = jax.lax.scan(body, (m.embed_tokens(tokens), ks, vs, 0), stacked)
      nxt = jnp.argmax(m.head(x)[:, -1], -1)[:, None].astype(jnp.int32)
      return nxt, ks, vs, lengths + 1

    return jax.lax.fori_loop(0, n, step, (tokens, ks, vs, lengths))[0]

  rows = []
  for b in batches:
    tokens = jnp.ones((b, 1), jnp.int32)
    for name, fn, args in (("unrolled", unrolled, (state, tokens)),
                           ("scan", scanned, (state, stacked, tokens))):
      best, compile_s = {}, None
      for n in (4, 20):
        lowered = jax.jit(functools.partial(fn, n)).lower(*args)
        t0 = time.perf_counter()
        compiled = lowered.compile()
        if compile_s is None:
          compile_s = time.perf_counter() - t0
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(3):
          t0 = time.perf_counter()
          jax.block_until_ready(compiled(*args))
          times.append(time.perf_counter() - t0)
        best[n] = min(times)
      step_ms = (best[20] - best[4]) / 16 * 1e3
      rows.append({"arm": name, "batch": b, "compile_s": compile_s, "ms_per_step": step_ms,
                   "per_call_ms": (best[4] - 4 * step_ms / 1e3) * 1e3})
      print(f"{name:>9} {b:>6} {compile_s:>10.2f} {step_ms:>12.1f}", flush=True)
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--layers", type=int, nargs="+", default=[8, 16, 36])
  p.add_argument("--remat", nargs="+", default=["none", "full"])
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--json", default="runs/bench_compile_depth.json")
  p.add_argument("--decode", action="store_true", help="unrolled vs scanned decode step")
  p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="--decode: batch sizes")
  args = p.parse_args(argv)
  if args.decode:
    layers = args.layers if args.layers != [8, 16, 36] else [28]
    rows = []
    print(f"{'arm':>9} {'batch':>6} {'compile s':>10} {'ms per step':>12}")
    for n in layers:
      cfg = ModelConfig(vocab_size=32768, hidden_size=1024, num_layers=n, num_heads=16,
                        num_kv_heads=8, head_dim=128, mlp_hidden=3072, tie_embeddings=True)
      print(f"{n} layers, {cfg.num_params() / 1e9:.2f}B parameters", flush=True)
      rows += [{"layers": n, **r} for r in decode_arms(cfg, args.batches, cache=64)]
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"jax": jax.__version__, "backend": jax.default_backend(), "mode": "decode",
                 "cores": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                 "rows": rows}, f, indent=1)
    return
  rows = []
  print(f"{'layers':>6} {'remat':>6} {'train s':>9} {'logprob s':>10}")
  for remat in args.remat:
    for n in args.layers:
      cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=n, num_heads=4,
                        num_kv_heads=2, head_dim=16, mlp_hidden=128, attention_block=64,
                        remat=remat)
      t = compile_seconds(cfg, args.seq, chunk=64)
      rows.append({"layers": n, "remat": remat, "train_compile_s": t["train"],
                   "logprob_compile_s": t["logprob"]})
      print(f"{n:>6} {remat:>6} {t['train']:>9.2f} {t['logprob']:>10.2f}", flush=True)
  os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
  with open(args.json, "w") as f:
    json.dump({"jax": jax.__version__, "backend": jax.default_backend(), "seq": args.seq,
               "rows": rows}, f, indent=1)


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
