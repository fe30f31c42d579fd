"""A run's step costs are the run's: no value in the machine's cost cache can crash a run or be
used when it is no sane cost (zero, negative, NaN, absurdly off its program's other costs, a
damaged file), a run reads the cache once and keeps what it read and measured in its run
directory, and a resumed run reads that back, whatever the machine's cache holds by then."""

import json
import logging
import math
import os
import subprocess
import sys

import jax
import pytest
from flax import nnx

# the preemption tests' tiny policy and RL config (adaptive engine, n-gram drafts)
from test_preemption import CFG, MODEL, TOK

from specjax.models import Decoder
from specjax.rl.config import RolloutConfig
from specjax.rl.loop import run_rl
from specjax.rl.run_lifecycle import COSTS_FILE
from specjax.rl.metrics_log import read_metrics
from specjax.rl.preemption import Preempted
from specjax.sampling.adaptive import best_draft_len
from specjax.sampling.calibration import EngineTuning
from specjax.sampling.cost_table import CostTable
from specjax.sampling.cost_cache import (CostCache, RunCosts, cost_key, cost_problem,
                                         implausible_keys, plausible_range)

# what must be equal between two runs of one trajectory
EXACT = ("reward/mean", "gen/tokens", "spec/num_drafts", "pg_loss", "grad_norm/policy")
POISON = {"zero": [0.0, 0.005], "negative": [-0.001, 0.0], "nan": [float("nan"), 0.001],
          "huge": [1e9, 0.0]}


@pytest.fixture(scope="module")
def policy():
  return nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))


def _cfg(cache: str, **calibration):
  engine = RolloutConfig.engine.replace(calibration=calibration)
  return CFG.replace(rollout=RolloutConfig(max_new_tokens=6, cost_cache=cache, engine=engine))


def _exact(run):
  rows = read_metrics(run["metrics_path"])
  return [{k: r.get(k) for k in EXACT} | {k: v for k, v in r.items() if k.startswith("engine/")}
          for r in rows]


def _read(path):
  with open(path) as f:
    return json.load(f)


def _write(path, costs):
  with open(path, "w") as f:
    json.dump({"format": 1, "costs": costs}, f)


def test_a_cost_is_refused_unless_finite_over_a_microsecond_and_below_ten_minutes():
  assert cost_problem((0.001, 0.0)) is None and cost_problem([0.5, 2.0]) is None
  for bad in ([0.0, 0.005], [1e-9, 0.0], [-1e-3, 0.0], [math.nan, 0.0], [math.inf, 0.0],
              [1e-3, -1e-3], [1e-3, math.nan], [700.0, 0.0], ["1", 0.0], [True, 0.0], [0.001],
              "x", None):
    assert cost_problem(bad) is not None, bad


def test_a_cost_out_of_line_with_its_programs_others_is_found_and_trusted_ones_stay():
  """A step at more rows or a longer draft costs neither under a quarter of one at fewer, nor
  over four times its share of the work; the key in the most conflicts goes."""
  good = {("p", 2, 0): 2e-4, ("p", 2, 7): 6e-4, ("p", 4, 0): 3e-4, ("p", 4, 7): 7e-4}
  assert implausible_keys(good) == {}
  for key in good:
    for factor in (100.0, 0.01):
      assert list(implausible_keys({**good, key: good[key] * factor})) == [key], (key, factor)
  # a run keeps its own timings in line: a later reader keeps them all
  lo, hi = plausible_range(("p", 4, 7), good)
  assert lo <= good[("p", 4, 7)] <= hi and hi == pytest.approx(6e-4 * 2 * 4)
  assert lo == pytest.approx(6e-4 / 4)
  for cost in (lo, hi):
    assert implausible_keys({**good, ("p", 4, 7): cost}) == {}
  # another program is no evidence, and refill costs (K = -1) are not compared
  assert implausible_keys({("p", 2, 0): 2e-4, ("q", 4, 7): 1.0, ("p", 8, -1): 5.0}) == {}
  # two keys and no third to side with either: both go; a trusted one (this run's) never does
  pair = {("p", 2, 0): 2e-4, ("p", 2, 7): 2e-1}
  assert set(implausible_keys(pair)) == set(pair)
  assert list(implausible_keys({("p", 2, 7): 2e-1}, {("p", 2, 0): 2e-4})) == [("p", 2, 7)]


def test_best_draft_len_refuses_a_cost_it_cannot_divide_by():
  assert best_draft_len({0: 1.0, 2: 2.0}, {0: 1e-3, 2: 1.5e-3}, 4)[0] == 2
  for bad in (0.0, -1e-3, math.nan):
    with pytest.raises(ValueError, match="step cost at K = 2"):
      best_draft_len({0: 1.0, 2: 2.0}, {0: 1e-3, 2: bad}, 4)


def test_poisoned_and_damaged_cache_entries_are_left_out_with_a_warning_and_written_over(
    tmp_path, caplog):
  path = str(tmp_path / "costs.json")
  good = {("p", 2, 0): (2e-4, 1e-3), ("p", 2, 7): (6e-4, 1e-3), ("p", 4, 0): (3e-4, 1e-3)}
  raw = {cost_key(k): list(v) for k, v in good.items()}
  raw |= {f"p/4/{k}": v for k, v in zip((1, 2, 3, 4), POISON.values())}
  raw |= {"p/4/7": [7e-2, 1e-3], "not a key": [1e-3, 0.0]}  # 100x its neighbours
  _write(path, raw)
  with caplog.at_level(logging.WARNING, logger="specjax"):
    assert CostCache(path).entries() == good
  lines = [r.getMessage() for r in caplog.records]
  for name in ("p/4/1", "p/4/2", "p/4/3", "p/4/4", "p/4/7", "'not a key'"):
    assert sum(name in line and path in line for line in lines) == 1, (name, lines)
  # a bad entry counts as absent: a measurement is stored over it; a good one stays
  cache = CostCache(path)
  assert cache.put(("p", 4, 1), (4e-4, 1e-3)) == (4e-4, 1e-3)
  assert cache.put(("p", 2, 0), (9e-4, 1e-3)) == good[("p", 2, 0)]
  # ... and one out of line only with the others is replaced when its stale value is named
  assert cache.put(("p", 4, 7), (7e-4, 1e-3), stale=(7e-2, 1e-3)) == (7e-4, 1e-3)
  with pytest.raises(ValueError, match="refusing to store p/4/5"):
    cache.put(("p", 4, 5), (0.0, 0.0))
  # a damaged file: one warning naming it, read as empty, written anew
  with open(path, "w") as f:
    f.write('{"format": 1, "costs": {"p/2/0": [0.0002, ')
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="specjax"):
    assert CostCache(path).entries() == {}
  assert [r.getMessage() for r in caplog.records if path in r.getMessage()] and \
      len(caplog.records) == 1
  assert CostCache(path).put(("p", 2, 0), (2e-4, 1e-3)) == (2e-4, 1e-3)
  assert CostCache(path).entries() == {("p", 2, 0): (2e-4, 1e-3)}


def test_a_poisoned_cached_cost_is_measured_again_and_replaced_in_the_cache(tmp_path):
  path = str(tmp_path / "costs.json")
  _write(path, {"p/8/0": [0.0, 0.005], "p/8/4": [0.002, 0.001], "p/16/0": [0.2, 0.001],
                "p/16/2": [0.0025, 0.001], "p/16/4": [0.003, 0.001]})
  table = CostTable(CostCache(path))
  timed = lambda per_step: (lambda m: (m, 0.001 + per_step * m))
  never = lambda m: pytest.fail("measured a sane cached cost")
  assert table.step_cost(("p", 8, 0), timed(0.001), 2, 1) == pytest.approx(0.001)
  assert table.step_cost(("p", 8, 4), never, 2, 1) == 0.002
  assert table.step_cost(("p", 16, 0), timed(0.0015), 2, 1) == pytest.approx(0.0015)
  assert table.step_cost(("p", 16, 4), never, 2, 1) == 0.003
  stored = CostCache(path).entries()
  assert stored[("p", 8, 0)] == pytest.approx((0.001, 0.001))
  assert stored[("p", 16, 0)] == pytest.approx((0.0015, 0.001))
  # a cached cost out of line with one this run measured is measured again too
  _write(path, {"q/8/4": [0.5, 0.001]})
  table = CostTable(CostCache(path))
  assert table.step_cost(("q", 8, 0), timed(0.001), 2, 1) == pytest.approx(0.001)
  assert table.step_cost(("q", 8, 4), timed(0.002), 2, 1) == pytest.approx(0.002)
  assert CostCache(path).entries()[("q", 8, 4)] == pytest.approx((0.002, 0.001))
  # a measurement that comes out near zero (two timings a hair apart) is no zero cost
  flat = CostTable()
  assert flat.step_cost(("r", 8, 0), lambda m: (m, 0.004), 2, 1) > 0
  # a stored tuning's bad rows are left out, so they are measured again
  tuning = EngineTuning()
  rows = [{"key": "s/8/0", "step_s": 0.0, "segment_s": 0.0, "calibrated_step_s": 0.0,
           "steps_measured": 0, "from_line": False},
          {"key": "s/8/4", "step_s": 0.002, "segment_s": 0.001, "calibrated_step_s": 0.002,
           "steps_measured": 0, "from_line": False}, {"key": "s/8/2"}]
  tuning.load_json({"format": 1, "costs": rows, "estimates": {}})
  assert not tuning.costs.has(("s", 8, 0)) and tuning.costs.has(("s", 8, 4))


def test_a_runs_snapshot_is_taken_once_and_kept_in_its_file(tmp_path):
  cache_path, run_path = str(tmp_path / "machine.json"), str(tmp_path / "run" / "costs.json")
  os.makedirs(os.path.dirname(run_path))
  _write(cache_path, {"p/8/0": [0.001, 0.001]})
  costs = RunCosts(CostCache(cache_path))
  costs.start(run_path, resume=False)
  _write(cache_path, {"p/8/0": [0.009, 0.001], "p/8/4": [0.002, 0.001]})  # another run's
  assert costs.get(("p", 8, 0)) == (0.001, 0.001) and costs.get(("p", 8, 4)) is None
  assert costs.put(("p", 8, 4), (0.003, 0.001)) == (0.002, 0.001)  # the machine's first value
  assert _read(run_path)["costs"] == {"p/8/0": [0.001, 0.001], "p/8/4": [0.002, 0.001]}
  resumed = RunCosts(CostCache(cache_path))
  _write(cache_path, {})
  resumed.start(run_path, resume=True)
  assert resumed.items() == {("p", 8, 0): (0.001, 0.001), ("p", 8, 4): (0.002, 0.001)}


def test_a_run_on_a_poisoned_cache_runs_and_a_second_run_of_its_seed_reproduces_it(
    policy, tmp_path, caplog):
  """Every entry of a cache a first run wrote poisoned one way or another (0, negative, NaN, over
  ten minutes, 100x): the run warns once per entry (naming the file and the key), measures them
  again and writes them over;
  a second run of the seed then reads what the first used and follows the same trajectory.
  (The check of cached costs against a run's own segments is off here: it would replace a
  cached figure by a timing, for later runs, and this test compares two runs.)"""
  cache = str(tmp_path / "costs.json")
  cfg = _cfg(cache, recheck_cached_costs=0.0)
  run_rl(cfg, policy, TOK, out_dir=str(tmp_path / "warm"), verbose=False)
  data = _read(cache)
  keys = sorted(k for k in data["costs"] if not k.endswith("/-1"))
  assert len(keys) >= 4
  poisons = list(POISON.values()) + [None]
  for i, key in enumerate(keys):
    bad = poisons[i % len(poisons)]
    data["costs"][key] = bad if bad is not None else [data["costs"][key][0] * 100, 0.0]
  _write(cache, data["costs"])
  with caplog.at_level(logging.WARNING, logger="specjax"):
    first = run_rl(cfg, policy, TOK, out_dir=str(tmp_path / "first"), verbose=False)
  # (an entry whose neighbours are all poisoned is caught against the run's own measurement:
  # the warning then names the run's file)
  run_file = str(tmp_path / "first" / COSTS_FILE)
  warned = [r.getMessage() for r in caplog.records
            if cache in r.getMessage() or run_file in r.getMessage()]
  for key in keys:
    assert sum(key in line for line in warned) == 1, (key, warned)
  repaired = CostCache(cache).entries()
  assert all(cost_problem(v) is None for v in repaired.values())
  assert implausible_keys({k: v[0] for k, v in repaired.items()}) == {}
  second = run_rl(cfg, policy, TOK, out_dir=str(tmp_path / "second"), verbose=False)
  assert _exact(first) == _exact(second)
  assert _read(str(tmp_path / "first" / COSTS_FILE)) == _read(str(tmp_path / "second" /
                                                                   COSTS_FILE))


def _rewrite_cache_elsewhere(path):
  """Another process rewrites the machine's cache: every cost tripled, one poisoned."""
  code = ("import json, sys; p = sys.argv[1]; d = json.load(open(p)); "
          "d['costs'] = {k: [v[0] * 3, v[1]] for k, v in d['costs'].items()}; "
          "d['costs'][sorted(d['costs'])[0]] = [0.0, 0.0]; json.dump(d, open(p, 'w'))")
  subprocess.run([sys.executable, "-c", code, path], check=True)


def test_a_resumed_run_equals_the_uninterrupted_one_while_the_machines_cache_changes(
    policy, tmp_path):
  cache = str(tmp_path / "costs.json")
  cfg = _cfg(cache)
  full = run_rl(cfg, policy, TOK, out_dir=str(tmp_path / "full"), verbose=False)
  split = str(tmp_path / "split")

  def stop_at(step, _):
    if step == 2:
      os.kill(os.getpid(), 15)

  with pytest.raises(Preempted):
    run_rl(cfg, policy, TOK, out_dir=split, hooks=[stop_at], verbose=False)
  kept = _read(os.path.join(split, COSTS_FILE))
  before = _read(cache)
  _rewrite_cache_elsewhere(cache)
  assert _read(cache) != before
  resumed = run_rl(cfg, policy, TOK, out_dir=split, verbose=False)
  assert resumed["start_step"] == 2
  assert _exact(resumed) == _exact(full)
  # the run kept its own costs (the machine's changed ones were not read)
  after = _read(os.path.join(split, COSTS_FILE))
  assert {k: v for k, v in after["costs"].items() if k in kept["costs"]} == kept["costs"]
  for x, y in zip(jax.tree.leaves(full["state"].params), jax.tree.leaves(resumed["state"].params)):
    assert (jax.device_get(x) == jax.device_get(y)).all()


def test_dense_and_paged_runs_keep_separate_costs():
  """The memory layout, page size, kernel launch and window block change a segment's program,
  so they are part of its cost's key: one tuning that ran a dense and a paged engine holds the
  costs of two programs, each timed on its own."""
  from test_queue import CFG as SMALL
  from test_queue import GREEDY, PROMPT_LENGTHS, PROMPTS

  from specjax.drafters import NgramDrafter
  from specjax.sampling import EngineConfig, speculative_generate
  from specjax.sampling.engine_config import CalibrationConfig, PagingConfig, QueueConfig
  from specjax.sampling.engine import program_statics

  dense = EngineConfig(queue=QueueConfig(max_rows=8, refill_fraction=0.25),
                       paging=PagingConfig(page_ahead=4), calibration=CalibrationConfig(repeats=1))
  paged = dense.replace(paging=dict(kv_cache_gb=1e-3, page_size=4))
  statics = {program_statics(e) for e in (
      dense, paged, paged.replace(paging=dict(page_size=8)),
      paged.replace(paging=dict(kernel_pages=4)), paged.replace(paging=dict(kernel_warps=2)),
      paged.replace(paging=dict(kernel_splits=2)), dense.replace(buckets=dict(window_block=16)))}
  assert len(statics) == 7
  target = Decoder(SMALL, rngs=nnx.Rngs(0))
  tuning = EngineTuning()
  timed = {}
  for name, engine in (("dense", dense), ("paged", paged)):
    speculative_generate(target, NgramDrafter(draft_len=2, n=2), (), PROMPTS, PROMPT_LENGTHS,
                         jax.random.key(1), GREEDY, engine=engine, tuning=tuning)
    rows = tuning.costs.to_json()
    timed[name] = {r["key"] for r in rows if not r["from_line"]} - \
        set().union(*timed.values())
  programs = {name: {k.rsplit("/", 2)[0] for k in keys} for name, keys in timed.items()}
  assert programs["dense"] and programs["paged"]
  assert not programs["dense"] & programs["paged"]
