"""Async vs sync RL, AR vs speculative rollouts: exposed generation and effective step time.

  python experiments/bench_async.py --steps 12 --skip 2 --lags 1 --out runs/bench_async.json

The setup of experiments/<--experiment>.py (embedded arithmetic task, its tiny base policy and
offline EAGLE-3 head, both cached under --cache-dir) runs in several loop arms, each with AR and
with EAGLE-3 rollouts: synchronous colocated `run_rl` on one device or on the mesh over all
devices (--sync-devices), and `run_rl_async` on the first N devices split into a generation and
a training group (--async-devices, --gen-fraction, --lags). Exposed generation is what the
trainer waits for: sync = data + prepare + gen + reward (the whole rollout side is on the
critical path), async = time/exposed_generation. Step time is time/step (async: the trainer's
wall clock per step, the effective step time). Means over steps after the first --skip
(compilation). Prints a table and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

from specjax.jobs import run_main

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--experiment", default="rl_zero", choices=("rl_zero", "rl_think"),
                 help="whose setup (task, base policy, draft head, RL config) to run")
  p.add_argument("--steps", type=int, default=12)
  p.add_argument("--skip", type=int, default=2, help="first steps left out of the means")
  p.add_argument("--lags", type=int, nargs="+", default=[1])
  p.add_argument("--gen-fraction", type=float, default=0.5)
  p.add_argument("--sync-devices", type=int, nargs="+", default=[1, 0],
                 help="sync arms: 1 = one device, 0 = the mesh over all devices")
  p.add_argument("--async-devices", type=int, nargs="+", default=[2, 8],
                 help="async arms: the first N devices, split by --gen-fraction")
  p.add_argument("--modes", nargs="+", default=["ar", "spec"], choices=("ar", "spec"))
  p.add_argument("--prompts-per-step", type=int, default=8)
  p.add_argument("--max-new-tokens", type=int, default=0, help="0: the experiment's own")
  p.add_argument("--fake-devices", type=int, default=8,
                 help="CPU only: XLA host devices to fake (0: leave XLA_FLAGS alone)")
  p.add_argument("--cache-dir", default=".cache/specjax")
  p.add_argument("--out", default="runs/bench_async.json")
  return p.parse_args(argv)


def _setup_devices(n: int) -> None:
  if n and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={n}").strip()


def _mean(records, key, skip):
  vals = [r.get(key, 0.0) for r in records[skip:]] or [r.get(key, 0.0) for r in records]
  return sum(vals) / max(len(vals), 1)


def arm_stats(records: list[dict], summary: dict, skip: int, is_async: bool) -> dict:
  m = lambda k: _mean(records, k, skip)
  rollout_side = m("time/data") + m("time/gen") + m("time/reward")
  out = {"step_s": m("time/step"), "gen_s": m("time/gen"), "logprob_s": m("time/logprob"),
         "train_s": m("time/train"), "reward_mean": m("reward/mean"),
         "first_step_s": records[0]["time/step"] if records else float("nan")}
  if is_async:
    out.update(exposed_generation_s=m("time/exposed_generation"),
               weight_sync_s=m("time/weight_sync"), rollout_side_s=rollout_side,
               version_gap_mean=m("async/version_gap"))
  else:
    out.update(exposed_generation_s=rollout_side + m("time/prepare"), weight_sync_s=0.0,
               rollout_side_s=rollout_side + m("time/prepare"), version_gap_mean=0.0)
  acc = [r["spec/acceptance_length"] for r in records[skip:] if "spec/acceptance_length" in r]
  out["acceptance_length"] = sum(acc) / len(acc) if acc else None
  return out


def main(argv=None) -> dict:
  args = parse_args(argv)
  _setup_devices(args.fake_devices)
  sys.path.insert(0, os.path.dirname(HERE))
  sys.path.insert(0, HERE)
  import jax
  from flax import nnx

  import importlib
  from specjax.jobs import setup_logging
  from specjax.jobs.base_policy import build_base_policy
  from specjax.jobs.draft_init import build_draft_head
  from specjax.jobs.driver import build_task, build_tokenizer, run_modes
  from specjax.rl.async_rl.config import AsyncConfig
  from specjax.rl.async_rl.loop import run_rl_async
  from specjax.rl.config import CheckpointConfig, ValidationConfig
  from specjax.rl.metrics_log import read_metrics
  from specjax.rl.loop import run_rl

  setup_logging()
  driver = importlib.import_module(args.experiment)
  exp = driver.DEFAULTS
  max_new = args.max_new_tokens or exp.rl.rollout.max_new_tokens
  rl = exp.rl.replace(steps=args.steps, prompts_per_step=args.prompts_per_step,
                      rollout=dataclasses.replace(exp.rl.rollout, max_new_tokens=max_new),
                      validation=ValidationConfig(every=0),
                      checkpoint=CheckpointConfig(save_on_exit=False, resume=False),
                      progress=False, tensorboard=False)
  exp = dataclasses.replace(exp, rl=rl, cache_dir=args.cache_dir)
  tok = build_tokenizer(exp)
  task = build_task(exp, tok)
  policy = build_base_policy(exp, tok, task, driver.answer_examples,
                             getattr(driver, "scratchpad_examples", None))
  head, maps = build_draft_head(exp, policy, tok, task) if "spec" in args.modes else (None, None)
  out_root = os.path.splitext(args.out)[0]
  modes = dict(run_modes(exp))
  rows = []
  for mode in args.modes:
    cfg = modes[mode]
    draft = dict(draft=head, draft_maps=maps) if mode == "spec" else {}
    all_devices = len(jax.devices())
    arms = [(f"sync/{n or all_devices}dev", None, n or all_devices) for n in args.sync_devices] + \
        [(f"async-lag{lag}/{n}dev", lag, n) for n in args.async_devices for lag in args.lags]
    for name, lag, n in arms:
      out_dir = os.path.join(out_root, f"{name.replace('/', '-')}-{mode}")
      t0 = time.perf_counter()
      if lag is None:  # colocated: one device, or the mesh over all of them
        summary = run_rl(cfg.replace(use_mesh=n > 1), nnx.split(policy), tok, task,
                         out_dir=out_dir, verbose=False, **draft)
      else:
        a = AsyncConfig(enabled=True, policy_lag=lag, gen_fraction=args.gen_fraction)
        summary = run_rl_async(cfg, a, nnx.split(policy), tok, task, out_dir=out_dir,
                               verbose=False, devices=jax.devices()[:n], **draft)
      records = read_metrics(summary["metrics_path"])
      stats = arm_stats(records, summary, args.skip, lag is not None)
      rows.append({"loop": name, "rollout": mode, "wall_s": time.perf_counter() - t0, **stats})
      print(f"[{name} {mode}] {args.steps} steps in {rows[-1]['wall_s']:.1f} s", flush=True)
      result = {"rows": rows, "args": vars(args), "machine": machine_info(jax),
                "model": dataclasses.asdict(rl.model), "rollout_batch": rl.rollout_batch,
                "max_new_tokens": max_new}
      os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
      with open(args.out, "w") as f:  # after every arm: a failed arm keeps the others
        json.dump(result, f, indent=2, default=str)
  print(format_table(rows))
  print(f"wrote {args.out}")
  return result


def machine_info(jax) -> dict:
  devices = jax.devices()
  return {"platform": platform.platform(), "processor": platform.machine(),
          "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "jax": jax.__version__,
          "backend": jax.default_backend(), "devices": len(devices),
          "device_kind": devices[0].device_kind}


def format_table(rows: list[dict]) -> str:
  head = (f"| {'loop':<17} | {'rollout':<7} | {'exposed gen s':>13} | {'weight sync s':>13} | "
          f"{'step s':>7} | {'gen s':>6} | {'logprob s':>9} | {'train s':>7} | {'acc. len':>8} | "
          f"{'gap':>4} |")
  sep = "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"
  lines = [head, sep]
  for r in rows:
    acc = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
    lines.append(f"| {r['loop']:<17} | {r['rollout']:<7} | {r['exposed_generation_s']:>13.3f} | "
                 f"{r['weight_sync_s']:>13.4f} | {r['step_s']:>7.3f} | {r['gen_s']:>6.3f} | "
                 f"{r['logprob_s']:>9.3f} | {r['train_s']:>7.3f} | {acc:>8} | "
                 f"{r['version_gap_mean']:>4.2f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
