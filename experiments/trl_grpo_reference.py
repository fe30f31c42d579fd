"""Reference point, NOT part of specjax: Hugging Face TRL's GRPOTrainer on the workload that
experiments/bench_train_side.py runs (same initial weights, tokenizer and prompts), phase by phase.

Needs its own virtual environment (torch + trl); specjax never imports this file:
  python -m venv ~/trl-venv && ~/trl-venv/bin/pip install torch==2.13.0 trl
  python experiments/bench_train_side.py --workload runs/grpo_workload   # writes the workload
  ~/trl-venv/bin/python experiments/trl_grpo_reference.py --workload runs/grpo_workload
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--workload", required=True)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group-size", type=int, default=4)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
  p.add_argument("--json", default="runs/trl_grpo_reference.json")
  args = p.parse_args()

  import torch
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
  from trl import GRPOConfig, GRPOTrainer

  if args.threads:
    torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  tok = PreTrainedTokenizerFast.from_pretrained(args.workload)
  model = AutoModelForCausalLM.from_pretrained(args.workload, dtype=torch.float32)
  model.generation_config.eos_token_id = tok.eos_token_id
  model.generation_config.pad_token_id = tok.pad_token_id
  with open(os.path.join(args.workload, "prompts.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  data = Dataset.from_list(rows)

  def exact_answer(completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]

  batch = args.prompts * args.group_size
  cfg = GRPOConfig(
      output_dir="/tmp/trl_grpo_out", per_device_train_batch_size=batch,
      num_generations=args.group_size, max_completion_length=args.max_new_tokens,
      steps_per_generation=1, num_iterations=1, max_steps=args.steps, learning_rate=1e-5,
      max_grad_norm=1.0, beta=0.0, gradient_checkpointing=False, temperature=1.0, use_cpu=True, bf16=False, fp16=False,
      logging_steps=1, report_to=[], save_strategy="no", seed=0, shuffle_dataset=False,
      dataloader_num_workers=0)
  # TRL turns on gradient checkpointing by default, which also disables the KV cache in
  # generation; specjax keeps activations (ModelConfig.remat="none") and caches, so off here too
  trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=cfg, train_dataset=data,
                        processing_class=tok)

  # phase timers around TRL's own methods
  times = collections.defaultdict(float)

  def timed(obj, name, phase, when=lambda: True):
    inner = getattr(obj, name)

    def wrapper(*a, **kw):
      if not when():
        return inner(*a, **kw)
      t0 = time.perf_counter()
      out = inner(*a, **kw)
      times[phase] += time.perf_counter() - t0
      return out
    setattr(obj, name, wrapper)

  timed(trainer, "_generate", "gen")
  timed(trainer, "_calculate_rewards", "reward")
  timed(trainer, "_get_per_token_logps_and_entropies", "logprob",
        when=lambda: not torch.is_grad_enabled())
  timed(trainer, "_prepare_inputs", "prepare_total")
  timed(trainer, "training_step", "step_total")
  steps = []
  cpu_mark = [time.process_time()]

  class Recorder:  # one record per optimizer step
    def __getattr__(self, _):
      return lambda *a, **kw: None

    def on_step_end(self, *a, **kw):
      rec = dict(times)
      rec["train"] = rec.get("step_total", 0) - rec.get("prepare_total", 0)
      rec["cpu"] = time.process_time() - cpu_mark[0]  # process CPU s (all threads) this step
      cpu_mark[0] = time.process_time()
      steps.append(rec)
      times.clear()

  trainer.add_callback(Recorder())
  trainer.train()

  phases = ("gen", "reward", "logprob", "train")
  rows = steps[1:] or steps
  med = {ph: statistics.median(r.get(ph, 0.0) for r in rows) for ph in phases}
  step = statistics.median(r.get("step_total", 0.0) for r in rows)
  cpu_step = statistics.median(r["cpu"] for r in rows)
  print(f"TRL GRPOTrainer {__import__('trl').__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of steps 2..{len(steps)}")
  for ph in phases:
    print(f"  {ph:<10}{med[ph]:>8.3f}")
  print(f"  {'step':<10}{step:>8.3f}   (logprob + train {med['logprob'] + med['train']:.3f} s)")
  print(f"  {'cpu/step':<10}{cpu_step:>8.3f}   (process CPU seconds per step, all threads)")
  os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
  with open(args.json, "w") as f:
    json.dump({"system": "trl", "args": vars(args), "phases_median_s": med,
               "step_median_s": step, "cpu_step_median_s": cpu_step, "per_step": steps}, f, indent=1)


if __name__ == "__main__":
  main()
