"""Peak memory of one RL train step (policy + online EAGLE-3 draft) and of the logprob pass against
sequence length, dense ("before") and memory-linear ("after": blockwise attention, remat, chunked
logits), V = 151936, hidden 256, one sequence. Peak = what XLA's compiled program needs: arguments
+ outputs - donated (aliased) buffers + temporaries (`compiled.memory_analysis()`); nothing runs.

  python experiments/bench_memory.py --seq 1024 4096 8192

With --prefill: the prefill program instead (a cached forward of the prompts into an empty KV
cache of prompt + 128 positions, no logits) at the Qwen3-1.7B attention and MLP shape (hidden
2048, 16/8 heads of 128, MLP 6144; --prefill-layers layers, --prefill-batch rows, float32), the
cache read whole (as off the CPU), attending every query at once ("one block") against
`QUERY_BLOCK` queries at a time ("query blocks", the default).

  python experiments/bench_memory.py --prefill --seq 512 2048

With --job CONFIG: a job's own train step and logprob pass, at the shapes its YAML (and any
further `--rl.*` flags) gives: the RL step's policy and draft head, one micro-batch of
`train.pack_rows` rows of prompt + max_new_tokens positions (the packed step's program), and its
optimizer update. On the CPU the figures are XLA's CPU buffer assignment (bfloat16 computed in
float32 there): an estimate, before a GPU runs the job.

  python experiments/bench_memory.py --job experiments/configs/rl_zero_gpu.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.head import init_head
from specjax.drafters.vocab import build_vocab_maps
from specjax.jobs import run_main
from specjax.models import Decoder, ModelConfig
from specjax.rl import train_step
from specjax.rl.config import DraftConfig, RLConfig
from specjax.rl.grpo import GRPOConfig
from specjax.rl.train_step import TrainBatch, Trainer

VARIANTS = {
    "dense": {"attention_block": 0, "remat": "none", "logits_chunk": 0},
    "chunked": {"attention_block": 512, "remat": "full", "logits_chunk": 128},
}


def model_config(vocab: int, variant: str) -> ModelConfig:
  return ModelConfig(vocab_size=vocab, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=64, mlp_hidden=768, **VARIANTS[variant])


def peak_bytes(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)
  return {"peak_bytes": int(peak), "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
          "temp_bytes": int(m.temp_size_in_bytes)}


def measure(variant: str, seq: int, vocab: int, draft_vocab: int, ttt_steps: int) -> list[dict]:
  mcfg = model_config(vocab, variant)
  cfg = RLConfig(model=mcfg, grpo=GRPOConfig(group_size=2),
                 draft=DraftConfig(kind="eagle3", online=True, ttt_steps=ttt_steps))
  policy = Decoder(mcfg, rngs=nnx.Rngs(0))
  head = init_head(mcfg, draft_vocab=draft_vocab, seed=0)
  maps = build_vocab_maps(np.arange(vocab)[::-1], vocab, draft_vocab)
  graphdef, policy_params = nnx.split(policy)
  head_graphdef, head_params = nnx.split(head)
  trainer = Trainer(cfg, graphdef, head_graphdef)
  state = trainer.init_state(policy_params, head_params, maps)
  tokens = jnp.zeros((1, seq), jnp.int32)
  zeros = jnp.zeros((1, seq), jnp.float32)
  batch = TrainBatch(tokens=tokens, loss_mask=zeros.at[:, seq // 8:].set(1.0),
                     advantages=jnp.ones((1,), jnp.float32), old_logprobs=zeros,
                     ref_logprobs=zeros)
  # after: the loop's donated step (new state written over the old); on-policy batch (the loop's
  # default with one optimizer step per batch)
  step_fn = train_step._step_jit_donated if variant == "chunked" else train_step._step_jit
  if variant == "chunked":
    batch = batch.replace(old_logprobs=None, sampler_logprobs=zeros)
  rows = []
  for phase, lower in (
      ("train", lambda: step_fn.lower(trainer, state, batch, jnp.float32(1.0))),
      ("logprob", lambda: train_step._logprobs_jit.lower(
          trainer, trainer.forward_params(state.params), tokens))):
    t0 = time.perf_counter()
    compiled = lower().compile()
    rows.append({"variant": variant, "phase": phase, "seq_len": seq,
                 "compile_s": time.perf_counter() - t0, **peak_bytes(compiled)})
  return rows


def measure_prefill(seq: int, layers: int, batch: int) -> list[dict]:
  from specjax.models import cache as cache_lib
  cfg = ModelConfig(vocab_size=151936, hidden_size=2048, num_layers=layers, num_heads=16,
                    num_kv_heads=8, head_dim=128, mlp_hidden=6144)
  graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

  def prefill(params, tokens):
    model = nnx.merge(graphdef, params)
    return model(tokens, cache=model.init_cache(batch, seq + 128), compute_logits=False).cache

  rows = []
  saved = cache_lib.CHUNKED_READ_BACKENDS, cache_lib.QUERY_BLOCK
  try:
    cache_lib.CHUNKED_READ_BACKENDS = ()  # whole reads, as on a GPU
    for variant, block in (("one block", 1 << 30), ("query blocks", saved[1])):
      cache_lib.QUERY_BLOCK = block
      t0 = time.perf_counter()
      # a new function each time: jit keeps one trace per function, and the settings are read
      # at trace time
      compiled = jax.jit(lambda *a: prefill(*a)).lower(params, tokens).compile()
      rows.append({"variant": variant, "phase": "prefill", "seq_len": seq, "batch": batch,
                   "layers": layers, "query_block": min(block, seq),
                   "compile_s": time.perf_counter() - t0, **peak_bytes(compiled)})
  finally:
    cache_lib.CHUNKED_READ_BACKENDS, cache_lib.QUERY_BLOCK = saved
  return rows


def measure_job(config: str, flags: list[str]) -> list[dict]:
  """The train step and logprob pass of the main job's config file `config` (+ `flags`)."""
  import sys
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import rl_zero
  from specjax.jobs.config import parse_config

  job = parse_config(rl_zero.DEFAULTS, ["--config", config, *flags])
  cfg, init = job.rl, job.draft_init
  mcfg, rows = cfg.model, cfg.train.pack_rows
  draft_vocab = init.draft_vocab or mcfg.vocab_size
  prompt = cfg.rollout.max_prompt_len
  if not prompt:  # the task's own width, as the run takes it (the main job's tasks are char-level)
    from specjax.models import CharTokenizer
    from specjax.rl.tasks import make_task
    prompt = make_task(cfg.task, CharTokenizer()).max_prompt_len
  seq = prompt + cfg.rollout.max_new_tokens
  policy = nnx.eval_shape(lambda: Decoder(mcfg, rngs=nnx.Rngs(0)))  # shapes only: nothing runs
  head_cfg = mcfg.replace(mlp_hidden=init.head_mlp_hidden) if init.head_mlp_hidden else mcfg
  head = nnx.eval_shape(lambda: init_head(head_cfg, draft_vocab=draft_vocab, seed=0))
  maps = build_vocab_maps(np.arange(mcfg.vocab_size)[::-1], mcfg.vocab_size, draft_vocab)
  graphdef, policy_params = nnx.split(policy)
  head_graphdef, head_params = nnx.split(head)
  trainer = Trainer(cfg, graphdef, head_graphdef)
  state = jax.eval_shape(lambda p, h: trainer.init_state(p, h, maps), policy_params, head_params)
  tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
  zeros = jax.ShapeDtypeStruct((rows, seq), jnp.float32)
  batch = TrainBatch(tokens=tokens, loss_mask=zeros,
                     advantages=jax.ShapeDtypeStruct((rows,), jnp.float32), old_logprobs=None,
                     ref_logprobs=zeros, sampler_logprobs=zeros)
  forward = jax.eval_shape(trainer.forward_params, state.params)
  meta = {"variant": "job", "seq_len": seq, "batch": rows, "layers": mcfg.num_layers,
          "hidden": mcfg.hidden_size, "dtype": mcfg.dtype, "remat": mcfg.remat,
          "attention_block": mcfg.attention_block, "draft": cfg.draft.kind,
          "draft_online": cfg.draft.online, "draft_vocab": draft_vocab,
          "head_mlp_hidden": head_cfg.mlp_hidden}
  out = []
  for phase, lower in (
      ("train", lambda: train_step._step_jit_donated.lower(trainer, state, batch,
                                                           jnp.float32(1.0))),
      ("logprob", lambda: train_step._logprobs_jit.lower(trainer, forward, tokens))):
    t0 = time.perf_counter()
    compiled = lower().compile()
    out.append({**meta, "phase": phase, "compile_s": time.perf_counter() - t0,
                **peak_bytes(compiled)})
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 8192])
  p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--draft-vocab", type=int, default=32000)
  p.add_argument("--ttt-steps", type=int, default=3)
  p.add_argument("--json", default="runs/bench_memory.json")
  p.add_argument("--prefill", action="store_true", help="measure the prefill program instead")
  p.add_argument("--prefill-layers", type=int, default=2)
  p.add_argument("--prefill-batch", type=int, default=64)
  p.add_argument("--job", metavar="CONFIG",
                 help="a main-job YAML: measure its train step and logprob pass (further "
                      "--rl.* flags apply to it)")
  args, flags = p.parse_known_args(argv)
  if flags and not args.job:
    p.error(f"unrecognized arguments: {' '.join(flags)}")
  rows = []
  print(f"{'variant':<12} {'phase':<8} {'seq':>6} {'peak GB':>8} {'temp GB':>8} {'args GB':>8} "
        f"{'compile s':>9}")
  if args.job:
    for r in measure_job(args.job, flags):
      rows.append(r)
      print(f"{'job':<12} {r['phase']:<8} {r['seq_len']:>6} {r['peak_bytes'] / 1e9:>8.3f} "
            f"{r['temp_bytes'] / 1e9:>8.3f} {r['argument_bytes'] / 1e9:>8.3f} "
            f"{r['compile_s']:>9.1f}", flush=True)
  for variant in [] if args.job else ["prefill"] if args.prefill else args.variants:
    for seq in args.seq:
      for r in (measure_prefill(seq, args.prefill_layers, args.prefill_batch) if args.prefill
                else measure(variant, seq, args.vocab, args.draft_vocab, args.ttt_steps)):
        rows.append(r)
        print(f"{r['variant']:<12} {r['phase']:<8} {seq:>6} {r['peak_bytes'] / 1e9:>8.3f} "
              f"{r['temp_bytes'] / 1e9:>8.3f} {r['argument_bytes'] / 1e9:>8.3f} "
              f"{r['compile_s']:>9.1f}", flush=True)
  os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
  meta = {"job": args.job, "flags": flags} if args.job else (
      {"shape": "qwen3-1.7b attention and MLP", "layers": args.prefill_layers,
       "batch": args.prefill_batch} if args.prefill else
      {"vocab": args.vocab, "draft_vocab": args.draft_vocab, "hidden": 256, "batch": 1,
       "variants": VARIANTS})
  with open(args.json, "w") as f:
    json.dump({"jax": jax.__version__, "backend": jax.default_backend(), **meta, "rows": rows},
              f, indent=1)


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
