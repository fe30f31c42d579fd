"""specjax's synchronous GRPO loop on the workload of the TRL comparison, phase by phase.

One 3.3M-parameter Qwen3 (d=256, 4 layers, char vocabulary), 8 prompts x 4 samples, 64 new tokens,
float32, AR rollouts, one optimizer step per batch. `--workload DIR` also writes that policy as a
Hugging Face checkpoint + tokenizer.json and the prompts, for experiments/trl_grpo_reference.py.

  python experiments/bench_train_side.py --steps 8 --workload runs/grpo_workload
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time

from flax import nnx

from specjax.jobs import run_main
from specjax.models import CharTokenizer, Decoder, ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.config import (
  CheckpointConfig,
  RLConfig,
  RolloutConfig,
  TaskConfig,
  ValidationConfig,
)
from specjax.rl.grpo import GRPOConfig
from specjax.rl.loop import run_rl
from specjax.rl.tasks.arithmetic import ArithmeticTask

PHASES = ("data", "prepare", "gen", "reward", "logprob", "train")


def model_config(tok: CharTokenizer) -> ModelConfig:
  return ModelConfig(vocab_size=tok.vocab_size, hidden_size=256, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=64, mlp_hidden=800, rope_theta=1e6,
                     tie_embeddings=True)


def rl_config(args, tok: CharTokenizer) -> RLConfig:
  return RLConfig(
      model=model_config(tok), grpo=GRPOConfig(group_size=args.group_size, beta=0.0),
      policy_optim=OptimConfig(lr=1e-5, clip_norm=1.0),
      rollout=RolloutConfig(temperature=1.0, max_new_tokens=args.max_new_tokens),
      task=TaskConfig(digits=2), steps=args.steps, prompts_per_step=args.prompts,
      progress=False, tensorboard=False, validation=ValidationConfig(every=0),
      checkpoint=CheckpointConfig(save_on_exit=False, resume=False), seed=args.seed)


def write_workload(path: str, policy: Decoder, tok: CharTokenizer, task: ArithmeticTask,
                   num_prompts: int) -> None:
  """HF checkpoint of the initial policy, a char-level tokenizer.json, prompts.jsonl."""
  from tokenizers import Regex, Tokenizer, models, pre_tokenizers

  from specjax.models import save_pretrained

  save_pretrained(policy, path)
  vocab = {t: i for i, t in enumerate(tok.control)}
  vocab.update({c: len(tok.control) + i for i, c in enumerate(tok.chars)})
  hf_tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  hf_tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  hf_tok.add_special_tokens(list(tok.control))
  hf_tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>",
               "bos_token": "<bos>", "eos_token": "<eos>"}, f)
  with open(os.path.join(path, "prompts.jsonl"), "w") as f:
    for i in range(num_prompts):
      ex = task.example(i)
      f.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group-size", type=int, default=4)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--workload", default="", help="also write the workload here for TRL")
  p.add_argument("--workload-only", action="store_true", help="write the workload and stop")
  p.add_argument("--json", default="runs/bench_train_side.json")
  args = p.parse_args(argv)

  tok = CharTokenizer()
  cfg = rl_config(args, tok)
  task = ArithmeticTask(cfg.task, tok)
  policy = Decoder(cfg.model, rngs=nnx.Rngs(args.seed))
  print(f"policy: {cfg.model.num_params() / 1e6:.2f}M parameters")
  if args.workload:
    write_workload(args.workload, policy, tok, task, args.steps * args.prompts)
  if args.workload_only:
    return
  cpu = [time.process_time()]  # process CPU seconds (all threads): robust to a shared CPU's load
  hook = lambda step, metrics: cpu.append(time.process_time())
  with tempfile.TemporaryDirectory() as out:
    summary = run_rl(cfg, nnx.split(policy), tok, task, out_dir=out, verbose=False, hooks=[hook])
    with open(summary["metrics_path"]) as f:
      records = [r for r in map(json.loads, f) if "gen/tokens" in r]  # steps, not events
  # medians over the steps after the first (which compiles)
  rows = records[1:] or records
  med = {ph: statistics.median(r.get(f"time/{ph}", 0.0) for r in rows) for ph in PHASES}
  step = statistics.median(sum(r.get(f"time/{ph}", 0.0) for ph in PHASES) for r in rows)
  tokens = statistics.median(r["gen/tokens"] for r in rows)
  cpu_steps = [b - a for a, b in itertools.pairwise(cpu)]
  cpu_step = statistics.median(cpu_steps[1:] or cpu_steps)
  print(f"specjax sync GRPO, {args.prompts} prompts x {args.group_size}, "
        f"{args.max_new_tokens} new tokens; median of steps 2..{len(records)}")
  print(f"  {'phase':<10}{'s':>8}")
  for ph in PHASES:
    print(f"  {ph:<10}{med[ph]:>8.3f}")
  print(f"  {'step':<10}{step:>8.3f}   (logprob + train {med['logprob'] + med['train']:.3f} s, "
        f"{tokens:.0f} generated tokens)")
  print(f"  {'cpu/step':<10}{cpu_step:>8.3f}   (process CPU seconds per step, all threads)")
  os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
  with open(args.json, "w") as f:
    json.dump({"system": "specjax", "args": vars(args), "phases_median_s": med,
               "step_median_s": step, "gen_tokens_median": tokens,
               "cpu_step_median_s": cpu_step, "cpu_per_step_s": cpu_steps,
               "per_step": [{k: v for k, v in r.items() if k.startswith("time/")}
                            for r in records]}, f, indent=1)


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
