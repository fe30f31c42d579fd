"""Nothing a user does loses a run: an interrupted validation, a resume from an older checkpoint,
another run's checkpoints, non-finite rewards. Tiny random policy, a few steps each."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from specjax.models import CharTokenizer, Decoder, ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.checkpoint import CheckpointExists, CheckpointMismatch, Checkpointer
from specjax.rl.config import CheckpointConfig, RLConfig, RolloutConfig, ValidationConfig
from specjax.rl.grpo import GRPOConfig
from specjax.rl.loop import run_rl
from specjax.rl.metrics_log import read_metrics, truncate_metrics
from specjax.rl.safety import NonFiniteError
from specjax.rl.tasks import Score
from specjax.rl.tasks.arithmetic import ArithmeticTask

TOK = CharTokenizer()
MODEL = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=16, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, mlp_hidden=32)
CFG = RLConfig(model=MODEL, grpo=GRPOConfig(group_size=2), prompts_per_step=2, steps=4,
               rollout=RolloutConfig(max_new_tokens=2), policy_optim=OptimConfig(lr=1e-2),
               validation=ValidationConfig(every=2, num_prompts=4, batch_size=4),
               checkpoint=CheckpointConfig(save_on_exit=True, resume=True), progress=False,
               tensorboard=False)


@pytest.fixture(scope="module")
def policy():
  return nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))


def _raw_steps(path):
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if "event" not in json.loads(line)]


def _strip_times(records):
  return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in records]


def _same_state(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_an_interrupted_validation_loses_no_step_and_the_resumed_run_matches(policy, tmp_path):
  full = run_rl(CFG, policy, TOK, out_dir=str(tmp_path / "full"), verbose=False)

  def interrupt(step, val):
    if step == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    run_rl(CFG, policy, TOK, out_dir=str(tmp_path / "split"), validation_hooks=[interrupt],
           verbose=False)
  # step 2 is checkpointed with its metrics still to write; the resumed run writes them first
  assert _raw_steps(tmp_path / "split" / "metrics.jsonl") == [1]
  resumed = run_rl(CFG, policy, TOK, out_dir=str(tmp_path / "split"), verbose=False)
  assert resumed["start_step"] == 2
  assert _raw_steps(resumed["metrics_path"]) == [1, 2, 3, 4]
  assert _strip_times(read_metrics(full["metrics_path"])) == \
      _strip_times(read_metrics(resumed["metrics_path"]))
  _same_state(full["state"], resumed["state"])


def test_a_resume_from_an_older_checkpoint_cuts_the_metrics_back_to_it(policy, tmp_path):
  cfg = CFG.replace(checkpoint=CheckpointConfig(every=2, save_on_exit=False, resume=True))

  def crash(step, metrics):
    if step == 3:
      raise RuntimeError("simulated crash after step 3 (no exit checkpoint)")

  with pytest.raises(RuntimeError, match="simulated crash"):
    run_rl(cfg, policy, TOK, out_dir=str(tmp_path), hooks=[crash], verbose=False)
  assert _raw_steps(tmp_path / "metrics.jsonl") == [1, 2, 3]
  with pytest.warns(UserWarning, match=r"removed \d+ line\(s\) after step 2"):
    resumed = run_rl(cfg, policy, TOK, out_dir=str(tmp_path), verbose=False)
  assert resumed["start_step"] == 2
  assert _raw_steps(resumed["metrics_path"]) == [1, 2, 3, 4]
  marks = [r["perf/compile_step"] for r in read_metrics(resumed["metrics_path"])]
  assert marks == [True, False, True, False]  # each process segment compiles once


def test_truncate_metrics_keeps_earlier_steps_and_events_and_drops_a_torn_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"event": "x", "step": 2}\n{"step": 2}\n{"step": 3}\n{"ste')
  assert truncate_metrics(str(path), 2) == 2
  assert path.read_text() == '{"step": 1}\n{"event": "x", "step": 2}\n{"step": 2}\n'
  assert not [p for p in os.listdir(tmp_path) if p != "metrics.jsonl"]  # no temp file left


def test_a_run_refuses_the_checkpoints_of_another_run(policy, tmp_path):
  ckpt_dir = str(tmp_path / "shared_ckpt")
  cfg = CFG.replace(steps=1, validation=ValidationConfig(),
                    checkpoint=CheckpointConfig(dir=ckpt_dir, resume=True))
  run_rl(cfg, policy, TOK, out_dir=str(tmp_path / "a"), verbose=False)
  other = cfg.replace(steps=2, grpo=GRPOConfig(group_size=2, clip_high=0.3))
  with pytest.raises(CheckpointMismatch, match=r"another run.*grpo.clip_high: 0.28 -> 0.3"):
    run_rl(other, policy, TOK, out_dir=str(tmp_path / "b"), verbose=False)
  # without resume, a directory holding checkpoints is refused rather than mixed into
  fresh = cfg.replace(checkpoint=CheckpointConfig(dir=ckpt_dir, resume=False))
  with pytest.raises(CheckpointExists, match="set CheckpointConfig.resume"):
    run_rl(fresh, policy, TOK, out_dir=str(tmp_path / "c"), verbose=False)
  # the same run extended by a step resumes (steps are not part of a run's identity)
  assert run_rl(cfg.replace(steps=2), policy, TOK, out_dir=str(tmp_path / "a"),
                verbose=False)["start_step"] == 1


class NaNRewards(ArithmeticTask):
  """Scores NaN from step `bad_from` on (by data position: prompts_per_step per step)."""

  bad_from = 2

  def score(self, completion, example):
    bad = self._position >= (self.bad_from - 1) * 2
    return Score(reward=float("nan") if bad else 0.5, correct=False)

  def examples(self, position, n):
    self._position = position
    return super().examples(position, n)


def test_non_finite_rewards_skip_the_update_then_stop_the_run_and_are_never_checkpointed(
    policy, tmp_path):
  cfg = CFG.replace(steps=6, max_bad_steps=2, validation=ValidationConfig())
  with pytest.raises(NonFiniteError, match=r"step 3: non-finite rewards, advantages.*"
                                           r"max_bad_steps=2"):
    with pytest.warns(UserWarning, match="step 2: non-finite rewards"):
      run_rl(cfg, policy, TOK, NaNRewards(cfg.task, TOK), out_dir=str(tmp_path), verbose=False)
  events = read_metrics(str(tmp_path), events=True)
  bad = [e for e in events if e["event"] == "nonfinite_step"]
  assert [(e["step"], e["update"], e["consecutive"]) for e in bad] == [(2, "skipped", 1),
                                                                      (3, "skipped", 2)]
  # the exit checkpoint (step 3) holds the parameters of step 1: both bad updates were skipped
  ckpt = Checkpointer(str(tmp_path / "checkpoints"))
  assert ckpt.steps() == [3]
  ok = run_rl(cfg.replace(steps=1, checkpoint=CheckpointConfig(resume=False)), policy, TOK,
              NaNRewards(cfg.task, TOK), out_dir=str(tmp_path / "one"), verbose=False)
  restored, meta = ckpt.restore(ok["state"])
  ckpt.close()
  assert meta["step"] == 3
  _same_state(restored.params, ok["state"].params)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(restored))


def test_report_timings_leave_out_the_compile_step_of_every_resumed_segment():
  from specjax.jobs.report import run_stats

  def rec(step, t, compiled):
    return {"step": step, "time/step": t, "time/gen": t / 2, "perf/compile_step": compiled}

  # steps 1-2 in one process, 3-4 after a resume: steps 1 and 3 compiled
  stats = run_stats([rec(1, 4.0, True), rec(2, 0.1, False), rec(3, 4.0, True),
                     rec(4, 0.3, False)])
  assert stats["compile_steps"] == [1, 3]
  assert stats["step_time_s"] == pytest.approx(0.2) and stats["rollout_time_s"] == \
      pytest.approx(0.1)
  assert stats["phase_mean_s"]["gen"] == pytest.approx(0.1)
  # records from before the mark existed: the first step only
  old = [{"step": i, "time/step": t} for i, t in enumerate((4.0, 0.1, 0.3), 1)]
  assert run_stats(old)["step_time_s"] == pytest.approx(0.2)


def test_prompts_longer_than_max_prompt_len_are_cut_with_a_warning_and_an_event(policy, tmp_path):
  cfg = CFG.replace(steps=1, validation=ValidationConfig(),
                    rollout=RolloutConfig(max_new_tokens=2, max_prompt_len=3))
  with pytest.warns(UserWarning, match=r"step 1: 2 prompt\(s\) longer than "
                                       r"RolloutConfig.max_prompt_len=3 were cut"):
    run_rl(cfg, policy, TOK, out_dir=str(tmp_path), verbose=False)
  (event,) = [e for e in read_metrics(str(tmp_path), events=True) if e["event"] == "prompts_cut"]
  assert (event["step"], event["count"], event["max_prompt_len"]) == (1, 2, 3)


def test_async_an_interrupted_validation_loses_no_step_and_the_resumed_run_matches(policy,
                                                                                  tmp_path):
  from specjax.rl.async_rl.config import AsyncConfig
  from specjax.rl.async_rl.loop import run_rl_async

  lockstep = AsyncConfig(policy_lag=0)  # resumes exactly (no queued batches to regenerate)
  cfg = CFG.replace(steps=3)
  run = lambda out, **kw: run_rl_async(cfg, lockstep, policy, TOK, out_dir=str(out),
                                       verbose=False, devices=jax.devices()[:2], **kw)
  full = run(tmp_path / "full")

  def interrupt(step, val):
    if step == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    run(tmp_path / "split", validation_hooks=[interrupt])
  resumed = run(tmp_path / "split")
  assert resumed["start_step"] == 2
  assert _raw_steps(resumed["metrics_path"]) == [1, 2, 3]
  timing = ("async/queue_depth", "time/worker_wait", "gen/tokens_per_s")
  strip = lambda rs: [{k: v for k, v in r.items() if k not in timing} for r in _strip_times(rs)]
  assert strip(read_metrics(full["metrics_path"])) == strip(read_metrics(resumed["metrics_path"]))
  _same_state(full["state"].params, resumed["state"].params)


def test_with_max_bad_steps_zero_the_first_non_finite_step_stops_the_run(policy, tmp_path):
  cfg = CFG.replace(steps=3, max_bad_steps=0, validation=ValidationConfig())
  with pytest.raises(NonFiniteError, match=r"step 2: non-finite rewards.*max_bad_steps=0"):
    run_rl(cfg, policy, TOK, NaNRewards(cfg.task, TOK), out_dir=str(tmp_path), verbose=False)
  (event,) = [e for e in read_metrics(str(tmp_path), events=True)
              if e["event"] == "nonfinite_step"]
  assert (event["step"], event["update"]) == (2, "stopped")
  assert Checkpointer(str(tmp_path / "checkpoints")).steps() == [2]


def test_jobs_keep_compiled_programs_in_the_cache_dir_unless_a_cache_is_set(tmp_path):
  """`use_compile_cache`: with no JAX cache directory set, compiled programs go to
  <cache_dir>/xla (also after a program compiled without a cache); a directory already set wins."""
  from jax.experimental.compilation_cache import compilation_cache

  from specjax.jobs.cache import use_compile_cache

  before = (jax.config.jax_compilation_cache_dir,
            jax.config.jax_persistent_cache_min_compile_time_secs)
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    jax.jit(lambda x: x * 3)(np.ones(3))  # JAX checks for a cache at its first compile
    path = use_compile_cache(str(tmp_path / "cache"))
    assert path == str(tmp_path / "cache" / "xla")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.jit(lambda x: jax.numpy.sin(x) * 5)(np.ones(7))
    assert os.listdir(path), "the program compiled after use_compile_cache was not stored"
    assert use_compile_cache(str(tmp_path / "other")) == path  # one set already: kept
    assert not (tmp_path / "other").exists()
  finally:
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    compilation_cache.reset_cache()
