"""Compile time of the unrolled decoder (forward + backward of a token-logprob loss) against depth.

The decoder's layers are a Python loop, so XLA sees every layer; this measures what that costs at
8, 16 and 36 layers (tiny widths: compile time depends on the graph, not the sizes).

  python experiments/bench_compile_depth.py --layers 8 16 36
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

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


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--layers", type=int, nargs="+", default=[8, 16, 36])
  p.add_argument("--remat", nargs="+", default=["none", "full"])
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--json", default="runs/bench_compile_depth.json")
  args = p.parse_args()
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
  main()
