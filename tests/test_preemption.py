"""Runs that survive a cluster: a stop signal ends a run at a step boundary with a checkpoint and
the resumed run equals an uninterrupted one (sync and async, default adaptive engine); a failed
checkpoint write stops the run with one clear error and keeps the last good checkpoint; one seed
gives one trajectory; the command-line job exits with its documented code on SIGTERM, and a second
signal exits at once with 128 + its number."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from specjax.models import CharTokenizer, Decoder, ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.async_rl.config import AsyncConfig
from specjax.rl.async_rl.loop import run_rl_async
from specjax.rl.checkpoint import Checkpointer, CheckpointWriteError
from specjax.rl.config import CheckpointConfig, DraftConfig, RLConfig, RolloutConfig
from specjax.rl.grpo import GRPOConfig
from specjax.rl.loop import run_rl
from specjax.rl.run_lifecycle import TUNING_FILE
from specjax.rl.metrics_log import read_metrics
from specjax.rl.preemption import PREEMPTED_EXIT_CODE, Preempted, StepBoundary
from specjax.sampling.calibration import EngineTuning
from specjax.sampling.cost_cache import CostCache
from specjax.sampling.cost_table import CostTable

ROOT = Path(__file__).resolve().parents[1]
TOK = CharTokenizer()
MODEL = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=16, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, mlp_hidden=32)
# the default engine: adaptive K over compacted buckets, an n-gram drafter
CFG = RLConfig(model=MODEL, grpo=GRPOConfig(group_size=2), prompts_per_step=2, steps=4,
               rollout=RolloutConfig(max_new_tokens=6), policy_optim=OptimConfig(lr=1e-2),
               draft=DraftConfig(kind="ngram"), checkpoint=CheckpointConfig(),
               progress=False, tensorboard=False)
EXACT = ("reward/mean", "gen/tokens", "data/position", "spec/num_drafts", "pg_loss",
         "grad_norm/policy")


@pytest.fixture(scope="module")
def policy():
  return nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))


def _cfg(tmp_path, **kw):
  return CFG.replace(rollout=RolloutConfig(max_new_tokens=6,
                                           cost_cache=str(tmp_path / "costs.json")), **kw)


def _steps(path):
  return [r["step"] for r in map(json.loads, open(path)) if "event" not in r]


def _exact(records):
  return [{k: r.get(k) for k in EXACT} for r in records]


def _same_params(a, b):
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _sigterm_at(step_to_stop):
  def hook(step, metrics):
    if step == step_to_stop:
      os.kill(os.getpid(), signal.SIGTERM)
  return hook


def test_sigterm_stops_at_a_step_boundary_and_the_resumed_run_equals_an_uninterrupted_one(
    policy, tmp_path):
  cfg = _cfg(tmp_path)
  full = run_rl(cfg, policy, TOK, out_dir=str(tmp_path / "full"), verbose=False)
  split = str(tmp_path / "split")
  with pytest.raises(Preempted) as stop:
    run_rl(cfg, policy, TOK, out_dir=split, hooks=[_sigterm_at(2)], verbose=False)
  assert stop.value.step == 2 and stop.value.signal_name == "SIGTERM"
  # the handlers are the process's own again once the run ended
  assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
  assert _steps(os.path.join(split, "metrics.jsonl")) == [1, 2]
  events = read_metrics(split, events=True)
  assert [e["event"] for e in events if e["event"] == "preempted"] == ["preempted"]
  assert Checkpointer(os.path.join(split, "checkpoints")).steps() == [2]
  assert os.path.exists(os.path.join(split, TUNING_FILE))
  resumed = run_rl(cfg, policy, TOK, out_dir=split, verbose=False)
  assert resumed["start_step"] == 2
  assert _steps(resumed["metrics_path"]) == [1, 2, 3, 4]  # every step once
  assert _exact(read_metrics(resumed["metrics_path"])) == _exact(read_metrics(full["metrics_path"]))
  _same_params(full["state"], resumed["state"])


def test_two_fresh_runs_with_one_seed_match_with_the_default_adaptive_engine(policy, tmp_path):
  cfg = _cfg(tmp_path, steps=3)
  a = run_rl(cfg, policy, TOK, out_dir=str(tmp_path / "a"), verbose=False)
  b = run_rl(cfg, policy, TOK, out_dir=str(tmp_path / "b"), verbose=False)
  ra, rb = read_metrics(a["metrics_path"]), read_metrics(b["metrics_path"])
  assert any(k.startswith("engine/steps_") and k.endswith(("k1", "k2", "k3"))
             for r in ra for k in r), "the engine never drafted: nothing to compare"
  assert _exact(ra) == _exact(rb)
  assert [{k: v for k, v in r.items() if k.startswith("engine/")} for r in ra] == \
      [{k: v for k, v in r.items() if k.startswith("engine/")} for r in rb]
  _same_params(a["state"], b["state"])


def test_async_stop_signal_keeps_every_batch_once_and_lockstep_resume_is_exact(policy, tmp_path):
  cfg = _cfg(tmp_path, steps=3)
  lockstep = AsyncConfig(policy_lag=0, is_correction=False)
  run = lambda out, **kw: run_rl_async(cfg, lockstep, policy, TOK, out_dir=str(tmp_path / out),
                                       verbose=False, devices=jax.devices()[:2], **kw)
  full = run("full")
  with pytest.raises(Preempted):
    run("split", hooks=[_sigterm_at(1)])
  events = read_metrics(str(tmp_path / "split"), events=True)
  assert [e["step"] for e in events if e["event"] == "preempted"] == [1]
  resumed = run("split")
  assert resumed["start_step"] == 1 and _steps(resumed["metrics_path"]) == [1, 2, 3]
  records = read_metrics(resumed["metrics_path"])
  assert [r["async/batch_index"] for r in records] == [0, 1, 2]  # none lost or used twice
  assert _exact(records) == _exact(read_metrics(full["metrics_path"]))
  _same_params(full["state"], resumed["state"])


def test_a_full_disk_at_a_checkpoint_stops_with_one_line_and_keeps_the_last_good_one(
    policy, tmp_path, monkeypatch):
  cfg = _cfg(tmp_path, steps=4, checkpoint=CheckpointConfig(every=1))
  out = tmp_path / "run"
  real = Checkpointer.save

  def failing(self, step, *a, **kw):
    if step == 3:  # orbax's writer fails half way: a partial dir, then the error
      os.makedirs(os.path.join(self.directory, "3.orbax-checkpoint-tmp-1", "state"))
      self.manager.save = lambda *a, **kw: (_ for _ in ()).throw(
          OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return real(self, step, *a, **kw)

  monkeypatch.setattr(Checkpointer, "save", failing)
  with pytest.raises(CheckpointWriteError) as err:
    run_rl(cfg, policy, TOK, out_dir=str(out), verbose=False)
  msg = str(err.value)
  assert "\n" not in msg and "No space left on device" in msg
  assert str(out / "checkpoints" / "3") in msg and "last good checkpoint is step 2" in msg
  assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"]  # partial one removed
  assert _steps(out / "metrics.jsonl") == [1, 2, 3]
  monkeypatch.setattr(Checkpointer, "save", real)
  resumed = run_rl(cfg, policy, TOK, out_dir=str(out), verbose=False)
  assert resumed["start_step"] == 2 and _steps(resumed["metrics_path"]) == [1, 2, 3, 4]


def test_a_metrics_write_over_quota_stops_with_one_line_naming_the_last_good_checkpoint(
    policy, tmp_path, monkeypatch):
  from specjax.rl import metrics_log

  cfg = _cfg(tmp_path, steps=4, checkpoint=CheckpointConfig(every=1))
  out = tmp_path / "run"
  real = metrics_log.append_jsonl

  def failing(path, record):
    if record.get("step") == 3:
      raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    real(path, record)

  monkeypatch.setattr(metrics_log, "append_jsonl", failing)
  with pytest.raises(metrics_log.RunWriteError) as err:
    run_rl(cfg, policy, TOK, out_dir=str(out), verbose=False)
  msg = str(err.value)
  assert "\n" not in msg and "Disk quota exceeded" in msg and str(out / "metrics.jsonl") in msg
  assert "last good checkpoint is step 2" in msg
  assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"]
  monkeypatch.setattr(metrics_log, "append_jsonl", real)
  resumed = run_rl(cfg, policy, TOK, out_dir=str(out), verbose=False)
  assert resumed["start_step"] == 2 and _steps(resumed["metrics_path"]) == [1, 2, 3, 4]


def test_a_save_the_disk_cannot_hold_is_refused_before_anything_is_written(tmp_path,
                                                                          monkeypatch):
  import collections
  import shutil

  ckpt = Checkpointer(str(tmp_path / "ck"))
  state = {"w": jax.numpy.ones((1000,))}
  ckpt.save(1, state, rng=jax.random.PRNGKey(0), data_position=0)
  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1000))
  with pytest.raises(CheckpointWriteError, match="No space left on device") as err:
    ckpt.save(2, state, rng=jax.random.PRNGKey(0), data_position=0)
  assert err.value.last_good == 1 and sorted(os.listdir(tmp_path / "ck")) == ["1"]
  ckpt.close()


def test_step_boundary_saves_by_steps_and_by_wall_time_and_costs_round_trip(tmp_path):
  now = [0.0]
  b = StepBoundary(every=3, every_minutes=1.0, signals=None, clock=lambda: now[0])
  assert b.poll(1) == (False, False) and b.poll(3) == (True, False)
  now[0] = 61.0
  assert b.poll(4) == (True, False)
  b.saved()
  assert b.poll(5) == (False, False)
  cache = CostCache(str(tmp_path / "c.json"))
  assert cache.put(("p", 2, 1), (0.5, 0.1)) == (0.5, 0.1)
  assert cache.put(("p", 2, 1), (0.7, 0.2)) == (0.5, 0.1)  # the first value stays
  table = CostTable(CostCache(str(tmp_path / "c.json")))
  assert table.step_cost(("p", 2, 1), lambda m: pytest.fail("measured a cached cost"), 2, 1) == 0.5
  t = EngineTuning()
  t.load_json(EngineTuning(costs=table).to_json())
  assert t.costs.rows() == table.rows()


# a process holding the stop-signal handlers, as a run does: it reports ready, then answers each
# line on stdin with the signal received so far
STOP_SIGNALS_PROCESS = """
import sys
from specjax.rl.preemption import StopSignals
signals = StopSignals.acquire(["SIGTERM", "SIGINT", "SIGUSR1"])
print("ready", flush=True)
for _ in sys.stdin:
  print(signals.received, flush=True)
"""


def test_a_first_stop_signal_only_sets_the_flag_and_a_second_exits_at_once_with_128_plus_n():
  proc = subprocess.Popen([sys.executable, "-c", STOP_SIGNALS_PROCESS], cwd=ROOT, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while True:  # the handler runs in the process's own time
      proc.stdin.write("?\n")
      proc.stdin.flush()
      if proc.stdout.readline() == "SIGTERM\n":
        break
      assert time.monotonic() < deadline, "the first SIGTERM never set the flag"
      time.sleep(0.01)
    assert proc.poll() is None  # the run would finish its step and save
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    err = proc.stderr.read()
    assert "received SIGTERM: finishing the step in flight" in err
    assert "second signal (SIGTERM): exiting at once" in err
  finally:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
      pipe.close()


def test_the_command_line_job_exits_75_on_sigterm_and_resumes_with_every_step_once(tmp_path):
  """The tiny fixture run of experiments/rl_zero.py: SIGTERM once the first step is logged;
  the process finishes its step, checkpoints and exits 75; --resume runs the rest. A step
  takes tens of milliseconds here, so the run is long enough that the signal lands well
  before its last step."""
  steps = 12
  out = tmp_path / "runs"
  metrics = out / "t" / "spec" / "metrics.jsonl"
  cmd = [sys.executable, "experiments/rl_zero.py", "--model-path", "tests/fixtures/qwen3_tiny",
         "--dataset", "tests/fixtures/gsm8k_tiny.jsonl", "--rl.draft.kind", "ngram",
         "--rl.draft.no-online", "--rl.prompts-per-step", "2", "--rl.grpo.group-size", "2",
         "--rl.rollout.max-new-tokens", "8", "--rl.validation.every", "0", "--no-compare",
         "--rl.steps", str(steps), "--out-dir", str(out), "--name", "t", "--rl.no-progress",
         "--rl.no-tensorboard", "--rl.rollout.cost-cache", str(tmp_path / "costs.json")]
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))  # one device
  cache = os.environ.get("SPECJAX_TEST_COMPILATION_CACHE")
  if cache:  # the resumed process reads the programs the first one compiled
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 150
  while not (metrics.exists() and _steps(metrics)) and proc.poll() is None:
    assert time.monotonic() < deadline, "no step logged in 150 s"
    time.sleep(0.05)
  sent = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  latency = time.monotonic() - sent
  assert proc.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("specjax: stopped by SIGTERM after step"), err[-3000:]
  stopped = _steps(metrics)
  assert stopped == list(range(1, len(stopped) + 1)) and len(stopped) < steps
  assert last.startswith(f"specjax: stopped by SIGTERM after step {len(stopped)};"), last
  print(f"preemption latency (SIGTERM to exit): {latency:.2f} s")
  done = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=180, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert _steps(metrics) == list(range(1, steps + 1))
