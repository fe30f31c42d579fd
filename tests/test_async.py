"""Asynchronous RL: the rollout worker (lag bound, accounting, errors, shutdown), the weight push to
the generation mesh, truncated importance sampling, and end-to-end runs on 8 fake CPU devices."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import CharTokenizer, Decoder, ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.async_rl.config import AsyncConfig
from specjax.rl.async_rl.importance import tis_weights
from specjax.rl.async_rl.loop import WeightPush, run_rl_async, setup_async
from specjax.rl.async_rl.worker import RolloutWorker, RolloutWorkerError
from specjax.rl.config import CheckpointConfig, DraftConfig, RLConfig, RolloutConfig
from specjax.rl.grpo import GRPOConfig, grpo_loss
from specjax.rl.loop import run_rl
from specjax.rl.metrics_log import read_metrics
from specjax.rl.tasks.arithmetic import ArithmeticTask

TOK = CharTokenizer()
MODEL = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=16, mlp_hidden=64)
CFG = RLConfig(model=MODEL, grpo=GRPOConfig(group_size=4), prompts_per_step=4, steps=6,
               rollout=RolloutConfig(max_new_tokens=3), policy_optim=OptimConfig(lr=1e-3),
               checkpoint=CheckpointConfig(save_on_exit=False), progress=False,
               tensorboard=False)
TIMEOUT_S = 120.0  # generous: a hang, not a slow box, is what these catch


def within(timeout: float, fn, *args, **kw):
  """fn(*args, **kw) in a daemon thread; fails the test if it has not returned after `timeout` s,
  re-raises its exception otherwise."""
  out = {}

  def target():
    try:
      out["value"] = fn(*args, **kw)
    except BaseException as e:  # noqa: BLE001 - handed back to the test
      out["error"] = e

  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(timeout)
  assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {timeout} s (hang)"
  if "error" in out:
    raise out["error"]
  return out["value"]


def workers_alive() -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == "rollout-worker" and t.is_alive()]


@pytest.fixture(scope="module")
def policy():
  return Decoder(MODEL, rngs=nnx.Rngs(0))


# -- config and pieces without a model -----------------------------------------------------------

def test_async_config_rejects_out_of_range_values_naming_the_field():
  for kw, field in [({"policy_lag": 3}, "policy_lag"), ({"policy_lag": -1}, "policy_lag"),
                    ({"gen_fraction": 1.0}, "gen_fraction"), ({"queue_size": 0}, "queue_size"),
                    ({"is_clip": 0.5}, "is_clip")]:
    with pytest.raises(ValueError, match=f"AsyncConfig.{field}"):
      AsyncConfig(**kw)


def test_tis_weight_scales_each_tokens_policy_gradient_term_and_nothing_else():
  rng = np.random.default_rng(0)
  b, t = 4, 6
  lp = jnp.asarray(rng.normal(-1.0, 0.3, (b, t)), jnp.float32)
  old = lp + jnp.asarray(rng.normal(0, 0.2, (b, t)), jnp.float32)
  sampler = old + jnp.asarray(rng.normal(0, 0.5, (b, t)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  mask = jnp.asarray(rng.random((b, t)) < 0.7, jnp.float32)
  gcfg = GRPOConfig(group_size=2, loss_agg="seq-mean-token-mean")
  ones = jnp.where(mask > 0, 1.0, 0.0)
  ref, ref_m = grpo_loss(lp, old, adv, mask, gcfg)
  got, got_m = grpo_loss(lp, old, adv, mask, gcfg, pg_weights=ones)
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  assert got_m.keys() == ref_m.keys()
  w = tis_weights(old, sampler, mask, cap=2.0)
  assert float(jnp.max(w)) <= 2.0 and bool(jnp.all(jnp.where(mask > 0, True, w == 0)))
  np.testing.assert_allclose(w, jnp.where(mask > 0, jnp.minimum(jnp.exp(old - sampler), 2.0), 0),
                             rtol=1e-6)
  # the gradient wrt each token's logprob is the unweighted one times that token's weight
  g_ref = jax.grad(lambda x: grpo_loss(x, old, adv, mask, gcfg)[0])(lp)
  g_w = jax.grad(lambda x: grpo_loss(x, old, adv, mask, gcfg, pg_weights=w)[0])(lp)
  np.testing.assert_allclose(g_w, g_ref * w, rtol=1e-5, atol=1e-8)


def _drive(worker: RolloutWorker, steps: int, train_s: float = 0.0) -> list:
  items = []
  for step in range(steps):
    item = worker.get(timeout=10)
    items.append(item)
    time.sleep(train_s)
    worker.publish(step + 1, f"params-{step + 1}")
  return items


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_worker_never_generates_from_params_older_than_the_lag_and_hands_each_batch_once(lag):
  seen = []

  def produce(index, version, params):
    assert params == f"params-{version}"
    seen.append((index, version))
    return index

  worker = RolloutWorker(produce, first_index=0, num_batches=12, policy_lag=lag, queue_size=2)
  with worker.start(0, "params-0"):
    items = within(30, _drive, worker, 12, 0.01)
  assert [i.index for i in items] == list(range(12)) == [i.payload for i in items]
  assert all(0 <= i.index - i.version <= lag for i in items)
  assert sorted(seen) == [(i.index, i.version) for i in items]
  assert (worker.produced, worker.consumed, worker.discarded) == (12, 12, 0)
  if lag:
    assert max(i.index - i.version for i in items) >= 1  # it did run ahead
  assert not workers_alive()


def test_worker_error_surfaces_in_the_trainer_thread_with_the_original_cause():
  def produce(index, version, params):
    if index == 2:
      raise ZeroDivisionError("boom in the worker")
    return index

  worker = RolloutWorker(produce, first_index=0, num_batches=5, policy_lag=1, queue_size=2)
  with pytest.raises(RolloutWorkerError, match="batch 2.*boom") as info:
    with worker.start(0, "p0"):
      within(30, _drive, worker, 5)
  assert isinstance(info.value.__cause__, ZeroDivisionError)
  assert not workers_alive()


def test_close_does_not_hang_on_a_worker_blocked_on_a_full_queue_or_waiting_for_params():
  for lag, queue_size in [(2, 1), (0, 4)]:  # full queue / waiting for a push that never comes
    worker = RolloutWorker(lambda i, v, p: i, first_index=0, num_batches=10, policy_lag=lag,
                           queue_size=queue_size).start(0, "p0")
    time.sleep(0.2)
    within(10, worker.close, 5.0)
    assert worker.produced - worker.discarded == 0 and not workers_alive()


# -- end to end on 8 fake devices --------------------------------------------------------------

class DigitTask(ArithmeticTask):
  """Arithmetic prompts with a dense reward (the share of digits in the completion) that a
  random-weight tiny policy can learn in a dozen GRPO steps."""

  def score(self, completion, example):
    from specjax.rl.tasks import Score

    r = sum(c.isdigit() for c in completion) / CFG.rollout.max_new_tokens
    return Score(reward=r, correct=r > 0.5)


class FailingTask(DigitTask):
  def example(self, index):
    if index >= 2 * CFG.prompts_per_step:
      raise ValueError(f"unreadable prompt {index}")
    return super().example(index)


RISE = CFG.replace(steps=16, grpo=GRPOConfig(group_size=8), policy_optim=OptimConfig(lr=1e-2))


def _run_async(cfg, async_cfg, policy, task_cls, out_dir, **kw):
  return within(TIMEOUT_S, run_rl_async, cfg, async_cfg, nnx.split(policy), TOK,
                task_cls(cfg.task, TOK), out_dir=str(out_dir), verbose=False, **kw)


@pytest.mark.parametrize("lag", [2, 1])
def test_async_run_completes_within_the_lag_bound_using_every_batch_once_and_reward_rises(
    policy, tmp_path, lag):
  summary = _run_async(RISE, AsyncConfig(policy_lag=lag), policy, DigitTask, tmp_path)
  records = read_metrics(summary["metrics_path"])
  steps = RISE.steps
  assert summary["steps"] == steps and [r["step"] for r in records] == list(range(1, steps + 1))
  assert [r["async/batch_index"] for r in records] == list(range(steps))
  gaps = [r["step"] - 1 - r["async/version"] for r in records]
  assert gaps == [r["async/version_gap"] for r in records]
  assert 0 <= min(gaps) and max(gaps) <= lag and max(gaps) >= 1
  assert summary["batches"] == {"produced": steps, "consumed": steps, "discarded": 0}
  assert summary["version_gap"]["max"] == max(gaps)
  for key in ("time/exposed_generation", "time/weight_sync", "time/logprob", "time/train",
              "time/step", "time/gen", "is/weight_mean", "mismatch/mean_abs"):
    assert all(key in r for r in records), key
  rewards = [r["reward/mean"] for r in records]
  assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.2, rewards
  assert not workers_alive()


def test_weight_push_puts_exactly_the_trainers_policy_and_draft_head_on_the_generation_mesh(
    policy):
  cfg = CFG.replace(draft=DraftConfig(kind="eagle3", online=True, ttt_steps=1))
  run, state, engine, gen_mesh = setup_async(cfg, AsyncConfig(), nnx.split(policy), TOK,
                                             DigitTask(cfg.task, TOK))
  state = state.replace(params=jax.tree.map(lambda x: x * 1.5 + 0.25, state.params))
  gen_policy, gen_draft = WeightPush(run.trainer, engine, gen_mesh)(state)
  gen_devices, train_devices = set(gen_mesh.devices.flat), set(run.mesh.devices.flat)
  assert gen_devices.isdisjoint(train_devices) and len(gen_devices | train_devices) == 8
  pairs = [(gen_policy, run.trainer.forward_params(state.params)),
           (gen_draft.head, state.params["draft"]),
           (gen_draft.embed, state.params["policy"]["embed"][...])]
  for gen, train in pairs:
    gen_leaves, train_leaves = jax.tree.leaves(gen), jax.tree.leaves(train)
    assert len(gen_leaves) == len(train_leaves) > 0
    for g, t in zip(gen_leaves, train_leaves):
      assert g.sharding.device_set <= gen_devices and t.sharding.device_set <= train_devices
      np.testing.assert_array_equal(np.asarray(g), np.asarray(t))


def test_lag_zero_through_the_async_machinery_matches_the_synchronous_loop(policy, tmp_path):
  cfg = RISE.replace(steps=3)
  sync = within(TIMEOUT_S, run_rl, cfg, nnx.split(policy), TOK, DigitTask(cfg.task, TOK),
                out_dir=str(tmp_path / "sync"), verbose=False)
  lock = _run_async(cfg, AsyncConfig(policy_lag=0, is_correction=False), policy, DigitTask,
                    tmp_path / "async", devices=jax.devices()[:2])
  a, b = read_metrics(sync["metrics_path"]), read_metrics(lock["metrics_path"])
  assert all(r["async/version_gap"] == 0 for r in b)
  for ra, rb in zip(a, b, strict=True):
    for key in ("reward/mean", "response/length_mean", "data/position"):
      assert ra[key] == rb[key], key
    for key in ("pg_loss", "entropy", "grad_norm/policy", "mismatch/mean_abs"):
      np.testing.assert_allclose(ra[key], rb[key], rtol=1e-5, atol=1e-7, err_msg=key)
  # atol 1e-5, a thousandth of one Adam step at lr 1e-2 (a wrong batch or step moves entries by
  # ~lr): gradients summed over packed micro-batches, one run on the trainer's mesh and one
  # without, differ in float summation order (measured: single entries 1.3e-6 and 2.6e-6 apart)
  for x, y in zip(jax.tree.leaves(sync["state"].params), jax.tree.leaves(lock["state"].params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_an_exception_in_the_worker_surfaces_in_the_main_thread_and_shuts_down(policy, tmp_path):
  with pytest.raises(RolloutWorkerError, match="unreadable prompt") as info:
    _run_async(RISE, AsyncConfig(policy_lag=1), policy, FailingTask, tmp_path)
  assert isinstance(info.value.__cause__, ValueError)
  assert len(read_metrics(str(tmp_path))) <= 2  # batches 0 and 1 were fine
  assert not workers_alive()


def test_an_exception_in_the_trainer_stops_the_worker(policy, tmp_path):
  def hook(step, metrics):
    if step == 2:
      raise KeyboardInterrupt("stop at step 2")

  with pytest.raises(KeyboardInterrupt):
    _run_async(RISE, AsyncConfig(policy_lag=2), policy, DigitTask, tmp_path, hooks=[hook])
  assert len(read_metrics(str(tmp_path))) == 2
  assert not workers_alive()
