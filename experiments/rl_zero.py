"""RL-Zero: GRPO from a weak base model, AR rollouts vs speculative rollouts side by side.

`python experiments/rl_zero.py` runs the embedded default (the trace task's long-tailed
scratchpads, each step on prompts not seen before, a decoder pretrained here and grown to 14.2M
parameters, drafts from an EAGLE-3 head, CPU, no downloads) and writes runs/rl_zero/: metrics
JSONL of both runs, summary.json, plots. Several RL seeds per arm: experiments/rl_zero_seeds.py.
A revisited pool of prompts, drafted from their earlier completions:
`--rl.task.pool-size 16 --rl.draft.kind eagle3-history` (faster rollouts, lower held-out
accuracy: README, "What the main job does").
Every knob is a flag (`--help`), or a YAML file (`--config my.yaml`); `--model-path` takes a local
Hugging Face checkpoint and `--dataset` a local JSONL/parquet math set.
"""

from __future__ import annotations

import sys

import numpy as np

from specjax.jobs import run_main, setup_logging
from specjax.jobs.base_policy import biased_answer
from specjax.jobs.config import BaseModelConfig, DraftInitConfig, ExperimentConfig, parse_config
from specjax.jobs.driver import run_experiment
from specjax.models import ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.config import (CheckpointConfig, DraftConfig, RLConfig, RolloutConfig, TaskConfig,
                               ValidationConfig)
from specjax.rl.grpo import GRPOConfig


def answer_examples(task, n: int, seed: int, bias: float) -> list[tuple[str, str]]:
  """Base-model text: the task's prompts (a stream RL never uses) with mostly biased answers.
  Tasks that write a scratchpad (the default `trace`, `--rl.task.name chain`) get it, with the
  final answer one too high (mod 10) with probability `bias`."""
  rng = np.random.default_rng(seed)
  out = []
  for e in task.examples(50_000_000 + 100_000 * seed, n):
    if hasattr(task, "scratchpad"):
      pad, answer = task.scratchpad(e).rsplit("#", 1)
      wrong = rng.random() < bias
      out.append((e.prompt, f"{pad}#{(int(answer) + 1) % 10 if wrong else answer}"))
    else:
      out.append((e.prompt, biased_answer(e, rng, bias)))
  return out


# The main job's proportions follow the NeMo-RL setting on a 2-core CPU (docs/BENCHMARKS.md):
# long-tailed scratchpads (11-165 tokens), few rows per step (2 prompts x 4 samples: in this task a
# prompt fixes its length, so two prompts give the live batch something to shrink to), and a policy
# large enough that decoding reads weights rather than computing (14.2M parameters), grown from a
# 1.2M decoder pretrained here (`specjax.jobs.grow`: new layers and MLP units start with zero output
# projections, so the grown policy computes exactly what the small one did). The train step leaves
# out the groups whose samples all scored the same (their advantages are exactly 0;
# RLConfig.train.skip_zero_advantage): about half of the sequences on the prompt stream here
# (three quarters on a revisited pool), which puts generation at 57% of the AR step on the stream
# (~69% on the pool; 40% when every sequence was trained). 800 pretraining steps:
# after 400 the base's sampled scratchpads were wrong too often for RL to find the right answers (+8
# points in 30 steps); after 800, +67. Temperature 0.7: sampled scratchpads are right more often (RL
# signal) and drafts are accepted more (2.38 vs 1.8-2.0 at 1). No online draft loss: it would add
# the head's 3-step TTT unroll to every train step, which the step speedup cannot afford here
# (`--rl.draft.online`; not measured in this configuration). A 32-token draft vocabulary: with 16
# (digits, '+=,#', EOS and 'a') the head could never draft a step's letter b..z, one scratchpad
# token in seven, and acceptance length was 2.1-2.5 over three runs; with 32 (the most frequent
# tokens, the early letters among them), 2.6-2.9 over eight. 220 offline head steps, not 150: on a
# base pretrained on another host, 150 steps left the TTT loss at 1.46 (step-0 agreement 0.80,
# acceptance 1.9-2.4, rollout 1.11-1.27x); 220 took it to 0.36 (0.95, 3.26, 1.58x) for 26 s more,
# 300 to 0.20 (0.97, 3.30, 1.63x) for 62 s more (those heads had Qwen3's layer; the head's layer is
# now Llama's, which vLLM and SGLang load: 220 steps leave its TTT loss at 0.81, agreement 0.87, and
# the job's acceptance at 5.75 against 5.94). Smallest live bucket 2, not 1: a bucket is up to four
# more programs to compile and calibrate (one per K) in the spec arm's first step (62 -> 39 s), and
# a one-row tail here lasts a step or two. The prompt stream (each step's prompts new, as a
# dataset visited once per epoch is within a run), drafted by the EAGLE-3 head up to K = 7: on it
# the head accepted 3.99 tokens per step (rollout 1.50x, seed 0), the head with a cross-prompt
# table 3.78 at matches of 6+ tokens (1.37x) and 2.39 at 3+ (1.11x). A pool of 16 prompts
# revisited epoch after epoch with `eagle3-history` drafts faster (from the second epoch on 6.2-6.8
# tokens per step; rollout 1.90x over eight seeds) but trains a policy 12 points less accurate on
# held-out prompts (0.52 against 0.64: 16 prompts teach less than 60). K is chosen among 0, 2, 4
# and 7 only: each K is a program per bucket to compile in the first step (every K in 0..7: 26
# programs, 114 s), and the engine ran 4, 5 and 7 past the first step. Measured in
# docs/BENCHMARKS.md ("Main job").
TRACE_STEPS = 24

DEFAULTS = ExperimentConfig(
    name="rl_zero",
    base=BaseModelConfig(steps=800, examples=6000, batch_size=32, lr=3e-3, bias=0.7,
                         pretrain_layers=2, pretrain_mlp_hidden=512),
    draft_init=DraftInitConfig(steps=220, prompts=64, batch_size=8, draft_vocab=32,
                               head_mlp_hidden=512),
    rl=RLConfig(
        model=ModelConfig(vocab_size=64, hidden_size=256, num_layers=8, num_heads=4,
                          num_kv_heads=2, head_dim=64, mlp_hidden=2048, tie_embeddings=True,
                          aux_layers=(1, 2, 3)),
        task=TaskConfig(name="trace", operands=TRACE_STEPS),
        grpo=GRPOConfig(group_size=4),
        policy_optim=OptimConfig(lr=2e-4, warmup_steps=2, clip_norm=1.0),
        draft_optim=OptimConfig(lr=1e-3, clip_norm=1.0),
        draft=DraftConfig(kind="eagle3", draft_len=7, online=False),
        rollout=RolloutConfig(temperature=0.7, max_new_tokens=7 * TRACE_STEPS - 3,
                              engine=RolloutConfig.engine.replace(
                                  buckets=dict(min_bucket=2), adaptive=dict(draft_lens=(2, 4)))),
        validation=ValidationConfig(every=10, num_prompts=64, batch_size=64),
        checkpoint=CheckpointConfig(every=0),  # on exit only: saving costs a step
        steps=30, prompts_per_step=2, seed=0, progress=True),
)


# `--smoke`: the same run at tiny shapes, seconds on a CPU, whatever --config gives (its flags
# come after the command line's): experiments/configs/rl_zero_gpu.yaml is run this way by
# tests/test_gpu_job.py, so that a GPU only ever runs code the CPU has run
SMOKE_FLAGS = (
    "--base.steps", "4", "--base.examples", "32", "--base.batch-size", "8",
    "--base.pretrain-layers", "1", "--base.pretrain-mlp-hidden", "32",
    "--draft-init.steps", "2", "--draft-init.prompts", "4", "--draft-init.batch-size", "2",
    "--draft-init.head-mlp-hidden", "64", "--rl.model.attention-block", "16",
    "--rl.model.hidden-size", "32", "--rl.model.num-layers", "4", "--rl.model.num-heads", "2",
    "--rl.model.num-kv-heads", "1", "--rl.model.head-dim", "16", "--rl.model.mlp-hidden", "64",
    "--rl.model.aux-layers", "1", "2", "3", "--rl.model.dtype", "float32",
    "--rl.rollout.gen-dtype", "float32", "--rl.task.operands", "4",
    "--rl.rollout.max-new-tokens", "28", "--rl.grpo.group-size", "2", "--rl.prompts-per-step",
    "2", "--rl.steps", "3", "--rl.rollout.engine.queue.max-rows", "2",
    "--rl.rollout.engine.paging.kv-cache-gb", "0.0001", "--rl.rollout.engine.buckets.min-bucket",
    "2", "--rl.draft.draft-len", "2", "--rl.rollout.engine.adaptive.draft-lens", "1",
    "--rl.validation.every", "2", "--rl.validation.num-prompts", "2",
    "--rl.validation.batch-size", "2", "--rl.train.pack-rows", "1")


def main(argv=None) -> dict:
  setup_logging()
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--smoke" in argv:
    argv = [a for a in argv if a != "--smoke"] + list(SMOKE_FLAGS)
  cfg = parse_config(DEFAULTS, argv)
  from specjax.sharding import initialize_distributed

  initialize_distributed()
  return run_experiment(cfg, base_examples=answer_examples)


if __name__ == "__main__":
  # a user's mistake, a failed write or a stop: one line on stderr and an exit code (README)
  run_main(main)
