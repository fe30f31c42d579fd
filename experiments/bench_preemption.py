"""Preemption latency: seconds from SIGTERM to the exit of an experiment process, on the tiny
fixtures (a 2-layer Qwen3-shaped checkpoint, GSM8K rows, n-gram drafts).

Each round starts `experiments/rl_zero.py` in a fresh run directory, waits until its first step
is in metrics.jsonl, sends SIGTERM and times the exit: the step in flight finishes, a checkpoint
of the last finished step is written, the logs are flushed and the process exits with code 75.
The rounds share one persistent compilation cache, so only the first one compiles from scratch.

  python experiments/bench_preemption.py --rounds 3 --out runs/bench_preemption.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.bench_io import write_json
from specjax.jobs import run_main

PREEMPTED_EXIT_CODE = 75


def command(out_dir: str, steps: int) -> list[str]:
  return [sys.executable, "experiments/rl_zero.py", "--model-path", "tests/fixtures/qwen3_tiny",
          "--dataset", "tests/fixtures/gsm8k_tiny.jsonl", "--rl.draft.kind", "ngram",
          "--rl.draft.no-online", "--rl.prompts-per-step", "2", "--rl.grpo.group-size", "2",
          "--rl.rollout.max-new-tokens", "8", "--rl.validation.every", "0", "--no-compare",
          "--rl.steps", str(steps), "--out-dir", out_dir, "--name", "p", "--rl.no-progress",
          "--rl.no-tensorboard"]


def logged_steps(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for line in f if line.endswith("\n") and '"event"' not in line)


def one_round(work: str, index: int, env: dict) -> dict:
  out = os.path.join(work, f"round{index}")
  metrics = os.path.join(out, "p", "spec", "metrics.jsonl")
  proc = subprocess.Popen(command(out, 1000), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  started = time.monotonic()
  while logged_steps(metrics) < 1:
    if proc.poll() is not None:
      raise RuntimeError(f"the run ended before its first step: {proc.stderr.read()[-2000:]}")
    time.sleep(0.01)
  first_step_s = time.monotonic() - started
  sent = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=600)
  latency = time.monotonic() - sent
  if proc.returncode != PREEMPTED_EXIT_CODE:
    raise RuntimeError(f"exit code {proc.returncode}, not {PREEMPTED_EXIT_CODE}: {err[-2000:]}")
  return {"latency_s": latency, "first_step_s": first_step_s,
          "steps_logged": logged_steps(metrics), "last_line": err.strip().splitlines()[-1]}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="specjax-preemption-") as work:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=os.path.join(work, "jax-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               SPECJAX_COST_CACHE=os.path.join(work, "costs.json"))
    rounds = [one_round(work, i, env) for i in range(args.rounds)]
  lat = [r["latency_s"] for r in rounds]
  result = {"rounds": rounds, "latency_s": {"median": statistics.median(lat), "min": min(lat),
                                           "max": max(lat)},
            "command": " ".join(command("<dir>", 1000)), "cpu_count": os.cpu_count()}
  print(json.dumps(result, indent=1))
  if args.out:
    write_json(args.out, result)
  return result


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
