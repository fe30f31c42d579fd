"""Same seed, same run: does a preempted and resumed run equal the uninterrupted one, on a loaded
machine, while another process rewrites the machine's engine cost cache in between?

On the tiny fixtures (a 2-layer Qwen3-shaped checkpoint, GSM8K rows, n-gram drafts, the adaptive
engine), with `--load` CPU-bound processes beside it all along: one uninterrupted run of
`--steps` steps, then `--tries` runs each stopped by SIGTERM after a random step in
[`--stop-min`, `--stop-max`] (exit 75, a checkpoint) and resumed with `--resume`. Every try
starts from the cost cache as the uninterrupted run left it; between stop and resume (unless
`--no-rewrite-cache`) another process triples every cost in it and zeroes one. Each resumed
run's per-step metrics (reward, tokens, drafts, data position, the engine's steps per K) are
compared with the uninterrupted run's. Prints a line per try and writes JSON.

  python experiments/bench_resume.py --tries 10 --load 1 --out runs/bench_resume.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.bench_io import write_json  # noqa: E402
from experiments.bench_preemption import command, logged_steps  # noqa: E402

PREEMPTED_EXIT_CODE = 75
COMPARED = ("reward/mean", "gen/tokens", "spec/num_drafts", "data/position")


def _burn() -> None:
  while True:
    pass


def _records(path: str) -> dict[int, dict]:
  out = {}
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      if "event" not in r:
        out[r["step"]] = {k: v for k, v in r.items()
                          if k in COMPARED or k.startswith("engine/steps_")}
  return out


def _rewrite_cache(path: str) -> None:
  code = ("import json, sys; p = sys.argv[1]; d = json.load(open(p)); "
          "d['costs'] = {k: [v[0] * 3, v[1]] for k, v in d['costs'].items()}; "
          "d['costs'][sorted(d['costs'])[0]] = [0.0, 0.0]; json.dump(d, open(p, 'w'))")
  subprocess.run([sys.executable, "-c", code, path], check=True)


def _run(cmd: list[str], env: dict, log: str) -> int:
  with open(log, "a") as f:
    return subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def one_try(work: str, index: int, stop_after: int, env: dict, steps: int, rewrite: bool,
            reference: dict[int, dict], cache_after_reference: str) -> dict:
  # each try starts from the machine's cache as the uninterrupted run left it (holding every
  # cost it measured), so its first part reads what that run used
  shutil.copyfile(cache_after_reference, env["SPECJAX_COST_CACHE"])
  out = os.path.join(work, f"try{index}")
  log = os.path.join(work, f"try{index}.log")
  metrics = os.path.join(out, "p", "spec", "metrics.jsonl")
  with open(log, "w") as f:
    proc = subprocess.Popen(command(out, steps), cwd=ROOT, env=env, stdout=f,
                            stderr=subprocess.STDOUT)
    while logged_steps(metrics) < stop_after:
      if proc.poll() is not None:
        raise RuntimeError(f"try {index} ended before step {stop_after}; log {log}")
      time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=900)
  if code != PREEMPTED_EXIT_CODE:
    raise RuntimeError(f"try {index}: exit code {code}, not {PREEMPTED_EXIT_CODE}; log {log}")
  stopped = logged_steps(metrics)
  if rewrite:
    _rewrite_cache(env["SPECJAX_COST_CACHE"])
  code = _run(command(out, steps) + ["--resume"], env, log)
  if code != 0:
    raise RuntimeError(f"try {index}: the resumed run exited {code}; log {log}")
  got = _records(metrics)
  differ = sorted(s for s in reference if got.get(s) != reference[s])
  return {"try": index, "stopped_after": stopped, "steps": len(got), "differing_steps": differ,
          "first_difference": differ[0] if differ else None, "equal": not differ}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tries", type=int, default=10)
  ap.add_argument("--steps", type=int, default=120)
  ap.add_argument("--stop-min", type=int, default=6)
  ap.add_argument("--stop-max", type=int, default=12)
  ap.add_argument("--load", type=int, default=1, help="CPU-bound processes beside the runs")
  ap.add_argument("--no-rewrite-cache", dest="rewrite", action="store_false")
  ap.add_argument("--seed", type=int, default=0, help="of the stop steps")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  if not 1 <= args.stop_min <= args.stop_max < args.steps:
    raise SystemExit(f"bench_resume: need 1 <= --stop-min <= --stop-max < --steps, got "
                     f"{args.stop_min}, {args.stop_max}, {args.steps}")
  rng = random.Random(args.seed)
  burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.load)]
  for b in burners:
    b.start()
  t0 = time.monotonic()
  try:
    with tempfile.TemporaryDirectory(prefix="specjax-resume-") as work:
      env = dict(os.environ, JAX_PLATFORMS="cpu",
                 JAX_COMPILATION_CACHE_DIR=os.path.join(work, "jax-cache"),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                 SPECJAX_COST_CACHE=os.path.join(work, "costs.json"))
      ref_dir = os.path.join(work, "reference")
      code = _run(command(ref_dir, args.steps), env, os.path.join(work, "reference.log"))
      if code != 0:
        raise RuntimeError(f"the uninterrupted run exited {code}")
      reference = _records(os.path.join(ref_dir, "p", "spec", "metrics.jsonl"))
      cache_after_reference = os.path.join(work, "costs_after_reference.json")
      shutil.copyfile(env["SPECJAX_COST_CACHE"], cache_after_reference)
      tries = []
      for i in range(args.tries):
        tries.append(one_try(work, i, rng.randint(args.stop_min, args.stop_max), env,
                             args.steps, args.rewrite, reference, cache_after_reference))
        t = tries[-1]
        print(f"try {i}: stopped after step {t['stopped_after']}, resumed: "
              f"{'equal' if t['equal'] else 'DIFFERS from step %d' % t['first_difference']} "
              f"({len(t['differing_steps'])} of {args.steps} steps differ)", flush=True)
  finally:
    for b in burners:
      b.terminate()
  equal = sum(t["equal"] for t in tries)
  # (what makes equality a test: the engine's K choices, which hang on the costs it reads)
  by_k: dict[str, int] = {}
  for r in reference.values():
    for k, v in r.items():
      if k.startswith("engine/steps_"):
        by_k[k.rsplit("_", 1)[1]] = by_k.get(k.rsplit("_", 1)[1], 0) + v
  print(f"the uninterrupted run's engine steps by K: {dict(sorted(by_k.items()))}")
  result = {"tries": tries, "equal": equal, "of": len(tries), "steps": args.steps,
            "reference_engine_steps_by_k": by_k,
            "load_processes": args.load, "rewrite_cache": args.rewrite,
            "cpu_count": os.cpu_count(), "wall_s": time.monotonic() - t0,
            "command": " ".join(command("<dir>", args.steps))}
  print(f"\nresumed runs equal to the uninterrupted one: {equal} of {len(tries)} "
        f"({args.load} CPU-bound process(es) beside, machine cache rewritten in between: "
        f"{args.rewrite}); {result['wall_s']:.0f} s")
  if args.out:
    write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
