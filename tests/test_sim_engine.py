"""Tests of the simulator's model of specjax's own engine (buckets, compaction, windows, adaptive
K), its per-machine calibration from benchmark JSON, advise and project_scaled. Pure numpy.
"""

import contextlib
import dataclasses
import importlib.util
import io
import json
import os

import numpy as np
import pytest

from specjax.sim import bench_data, engine_model, machine_fit, phases
from specjax.sim.catalog import get_hardware, get_model
from specjax.sim.continuous_model import ContinuousEngineConfig, simulate_continuous
from specjax.sim.cost import Efficiency
from specjax.sim.engine_cost import EngineCost
from specjax.sim.engine_model import EngineModelConfig, simulate_engine, tokens_per_step
from specjax.sim.scaled import project_scaled
from specjax.sim.simulate import Scenario, compare
from specjax.sim.workload import Workload, get_workload

TINY = bench_data.model_spec({"hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2,
                              "head_dim": 32, "vocab": 256})
CPU_EFF = machine_fit.CPU_START


def flat_cost(bucket, k, window):
  return 1e-3 * bucket  # independent of K and window


def test_buckets_are_powers_of_two_below_the_batch_down_to_the_minimum():
  assert EngineModelConfig(batch=64, prompt_len=8, max_new=16,
                           min_bucket=8).buckets() == [64, 32, 16, 8]
  assert EngineModelConfig(batch=48, prompt_len=8, max_new=16,
                           min_bucket=8).buckets() == [48, 32, 16, 8]
  assert EngineModelConfig(batch=4, prompt_len=8, max_new=16).buckets() == [4, 2, 1]
  assert EngineModelConfig(batch=64, prompt_len=8, max_new=16, min_bucket=16,
                           dp=4).buckets() == [64, 32, 16]


def test_tokens_per_step_is_one_plus_the_cumulative_rates():
  mean, var = tokens_per_step([0.8, 0.5, 0.2], 3)
  assert mean == pytest.approx(2.5)
  assert var > 0
  assert tokens_per_step([0.8, 0.5], 0) == (1.0, 0.0)


def test_equal_lengths_ar_runs_max_new_minus_one_iterations_in_one_bucket():
  cfg = EngineModelConfig(batch=16, prompt_len=8, max_new=50, windowed=False)
  run = simulate_engine(cfg, [50] * 16, [], flat_cost)
  assert run.iterations == 49 and len(run.segments) == 1
  assert run.seconds == pytest.approx(49 * 16e-3)


def test_compaction_moves_live_rows_to_smaller_buckets_and_beats_the_static_engine():
  lengths = [10] * 24 + [100] * 8
  compact = simulate_engine(EngineModelConfig(batch=32, prompt_len=8, max_new=100,
                                              windowed=False, min_bucket=8),
                            lengths, [], flat_cost)
  static = simulate_engine(EngineModelConfig(batch=32, prompt_len=8, max_new=100, compact=False,
                                             windowed=False), lengths, [], flat_cost)
  assert [s.bucket for s in compact.segments] == [32, 8]
  assert compact.segments[1].live_rows_start == 8
  assert compact.seconds < 0.4 * static.seconds
  assert sum(s.tokens for s in compact.segments) == pytest.approx(sum(lengths) - 32)


def test_windows_grow_in_multiples_of_128_up_to_the_static_cache():
  cfg = EngineModelConfig(batch=8, prompt_len=100, max_new=300)
  run = simulate_engine(cfg, [300] * 8, [], lambda b, k, w: 1e-6 * w)
  windows = [s.window for s in run.segments]
  assert windows == sorted(windows) and windows[0] == 128
  assert all(w % 128 == 0 or w == cfg.cache_size for w in windows)
  assert windows[-1] == min(cfg.cache_size, 512)


def test_adaptive_k_is_zero_when_verify_costs_k_plus_one_steps_and_max_when_free():
  rates = [0.7, 0.5, 0.3, 0.2]
  cfg = EngineModelConfig(batch=16, prompt_len=8, max_new=64, max_draft_len=4, adaptive=True)
  bound = simulate_engine(cfg, [64] * 16, rates, lambda b, k, w: 1e-3 * (k + 1))
  free = simulate_engine(cfg, [64] * 16, rates, lambda b, k, w: 1e-3)
  assert set(bound.k_per_bucket.values()) == {0}
  assert set(free.k_per_bucket.values()) == {4}
  assert free.seconds < bound.seconds


def test_acceptance_noise_lengthens_the_static_tail():
  rates = [0.7, 0.5, 0.3]
  cfg = EngineModelConfig(batch=64, prompt_len=8, max_new=200, draft_len=3, max_draft_len=3,
                          compact=False, windowed=False)
  run = simulate_engine(cfg, [200] * 64, rates, flat_cost)
  assert run.iterations > 199 / tokens_per_step(rates, 3)[0]


def test_engine_config_rejects_bad_values_naming_the_field():
  with pytest.raises(ValueError, match="EngineModelConfig.batch"):
    EngineModelConfig(batch=30, prompt_len=8, max_new=16, dp=4)
  with pytest.raises(ValueError, match="EngineModelConfig.draft_len"):
    EngineModelConfig(batch=8, prompt_len=8, max_new=16, draft_len=5, max_draft_len=4)
  with pytest.raises(ValueError, match="EngineModelConfig.arm"):
    EngineModelConfig.for_arm("spec_magic", batch=8, prompt_len=8, max_new=16)


def _engine_json(path, truth: Efficiency, drop=None):
  """A bench_engine-schema JSON whose times come from the model at `truth`."""
  cfg = {"hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": 256,
         "batch": 32, "max_new": 96, "prompt_len": 32, "temperature": 1.0, "max_draft_len": 3,
         "length_quantiles": [8, 16, 30, 50, 96]}
  model = bench_data.model_spec(cfg)
  draft = bench_data.model_spec({**cfg, "layers": 1})
  ec = EngineCost(model, machine_fit.CPU, truth, "draft-model", draft)
  cache = 32 + 96 + 3 + 1
  rows = [{"bucket": b, "draft_len": k, "step_s": ec.step(b, k, cache)}
          for b in (32, 16, 8) for k in (0, 1, 3)]
  data = {"machine": "test", "command": "synthetic", "config": cfg, "target_params": 1,
          "calibration": {"rows": rows, "drafter": "draft_model"}, "arms": {}}
  for arm in ("ar_static", "ar_compact", "spec_adaptive"):
    data["arms"][arm] = {"rollout_s": 1.0, "acceptance_length": 2.0 if "spec" in arm else 1.0,
                         "tokens": 1000, "k_per_bucket": {}, "segments": []}
  path.write_text(json.dumps(data))
  _, arms = bench_data.engine_cases(str(path))
  for arm, case in zip(list(data["arms"]), arms):
    data["arms"][arm]["rollout_s"] = case.predict(truth)
  if drop:
    del data["config"][drop]
  path.write_text(json.dumps(data))
  return data


def test_fit_on_bench_engine_calibration_predicts_its_arms(tmp_path):
  truth = CPU_EFF.replace(bw=0.3, kv_bw=0.02, flops=0.4, step_overhead_s=3e-4)
  _engine_json(tmp_path / "e.json", truth)
  steps, arms = bench_data.engine_cases(str(tmp_path / "e.json"))
  assert len(steps) == 9 and {c.name.split()[-1] for c in arms} == {
      "ar_static", "ar_compact", "spec_adaptive"}
  out = machine_fit.validate(steps, arms, start=CPU_EFF,
                             fields=("bw", "kv_bw", "flops", "step_overhead_s"),
                             run_steps={"d128": steps})
  assert out["fit"]["max_abs_error"] < 0.02
  assert out["held_out"]["max_abs_error"] < 0.05
  assert out["held_out_rollouts_load_scaled"]["max_abs_error"] < 0.05


def test_bench_engine_json_missing_field_is_named(tmp_path):
  _engine_json(tmp_path / "e.json", CPU_EFF, drop="length_quantiles")
  with pytest.raises(ValueError, match="length_quantiles"):
    bench_data.engine_cases(str(tmp_path / "e.json"))


def test_specjax_engine_scenario_runs_and_static_cache_limits_rows_per_wave():
  w = Workload(name="t", prompts=32, samples=8, prompt_len=128, mean_response_len=800.0,
               max_response_len=4096, acceptance_length=2.5)
  c = compare(Scenario(model="qwen3-8b", hardware="h100", gpus=8, workload=w,
                       engine="specjax", adaptive=True, gen_mp=1))
  assert c.rollout_speedup > 1.0
  assert c.spec.gen_detail.slots <= c.spec.gen_detail.rows_per_replica
  with pytest.raises(ValueError, match="Scenario.adaptive"):
    Scenario(adaptive=True)


def test_moe_learner_phases_pay_expert_all_to_all_and_active_flops_only():
  hw, eff = get_hardware("gb200"), Efficiency()
  w = Workload(name="t", prompts=64, samples=8, mean_response_len=1000.0, max_response_len=4096)
  moe = get_model("qwen3-235b-a22b")
  assert phases.all_to_all_time(moe, hw, eff, 64, w, 1.0) > 0
  assert phases.all_to_all_time(get_model("qwen3-32b"), hw, eff, 64, w, 1.0) == 0
  # a dense model with the MoE's total parameters trains ~10x slower: FLOPs follow active params
  dense = get_model("qwen3-32b")
  ratio = phases.train_time(moe, hw, eff, 64, w) / phases.train_time(dense, hw, eff, 64, w)
  assert ratio < 1.0 and moe.num_params > 7 * dense.num_params


def test_project_scaled_returns_ar_and_spec_times_and_speedups():
  r = project_scaled(batch=64, completion_lengths=[20, 40, 60, 200], acceptance_length=2.2,
                     draft_kind="eagle3", max_new=256)
  for k in ("ar_gen_s", "spec_gen_s", "ar_step_s", "spec_step_s", "rollout_speedup",
            "step_speedup"):
    assert r[k] > 0, k
  assert r["model"] == "qwen3-8b" and r["gpus"] == 8 and r["hardware"] == "h100"
  with pytest.raises(ValueError, match="project_scaled.draft_kind"):
    project_scaled(batch=8, completion_lengths=10, acceptance_length=2.0, draft_kind="magic")


def test_cli_advise_prints_a_recommendation_and_assumptions():
  path = os.path.join(os.path.dirname(__file__), "..", "experiments", "simulate.py")
  spec = importlib.util.spec_from_file_location("simulate_cli_engine", path)
  cli = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cli)
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    cli.main(["--advise", "--model", "qwen3-8b", "--hardware", "h100", "--gpus", "8",
              "--prompts", "16", "--samples", "8", "--max-response-len", "2048",
              "--mean-response-len", "500", "--max-lag", "1", "--drafters", "eagle3,ngram",
              "--engine", "specjax", "--gen-mp", "1", "--json"])
  out = json.loads(buf.getvalue())
  assert {"recommendation", "best_per_drafter", "assumptions", "ar"} <= set(out)
  assert set(out["best_per_drafter"]) == {"eagle3", "ngram"}
  assert np.isfinite(out["best_per_drafter"]["eagle3"]["step_s"])


def test_engine_arm_names_map_to_configs():
  s = EngineModelConfig.for_arm("spec_static", batch=8, prompt_len=8, max_new=16)
  assert s.draft_len == 3 and not s.compact and not s.windowed
  a = EngineModelConfig.for_arm("spec_adaptive", batch=8, prompt_len=8, max_new=16)
  assert a.adaptive and a.compact
  assert EngineModelConfig.for_arm("ar_compact", batch=8, prompt_len=8,
                                   max_new=16).draft_len == 0
  assert engine_model.ARMS[0] == "ar_static"


def test_forward_probe_json_loads_wall_or_cpu_seconds_and_names_a_missing_field(tmp_path):
  row = {"batch": 4, "tokens": 2, "window": 128, "seconds": 2e-3, "seconds_cpu": 1e-3}
  data = {"kind": "forward_costs", "models": {"m": {"model": {
      "hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 32, "vocab": 128},
      "rows": [row]}}}
  path = tmp_path / "f.json"
  path.write_text(json.dumps(data))
  assert bench_data.forward_cases(str(path))[0].seconds == 2e-3
  assert bench_data.forward_cases(str(path), clock="cpu")[0].seconds == 1e-3
  del row["seconds_cpu"]
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="seconds_cpu"):
    bench_data.forward_cases(str(path), clock="cpu")
  with pytest.raises(ValueError, match="clock"):
    bench_data.forward_cases(str(path), clock="gpu")


def test_bench_engine_layout_with_percentile_lengths_and_drafter_prefixed_arms(tmp_path):
  """experiments/bench_engine.py writes length percentiles as fractions of max_new, names arms
  <drafter>_<engine> and shares one calibration table between two drafters."""
  cfg = {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 32, "vocab": 512,
         "batch": 16, "max_new": 100, "prompt_len": 16, "temperature": 1.0, "max_draft_len": 4,
         "static_k": 3, "draft_vocab": 128,
         "length_quantiles": {"p10": 0.1, "p50": 0.25, "p90": 1.0}}
  arm = {"rollout_s": 1.0, "acceptance_length": 2.0, "tokens": 600, "k_per_bucket": {"16": 2},
         "segments": [{"bucket": 16, "draft_len": 2, "window": 0, "iterations": 10,
                       "live_rows_start": 16, "seconds": 0.5, "tokens": 300}]}
  data = {"machine": "t", "command": "t", "config": cfg, "target_params": 1,
          "calibration": {"rows": [{"bucket": 16, "draft_len": 0, "step_s": 0.01}],
                          "drafter": "eagle3+ngram"},
          "arms": {"ar_static": dict(arm, acceptance_length=1.0), "spec_static": arm,
                   "ngram_adaptive": arm}}
  path = tmp_path / "bench_engine.json"
  path.write_text(json.dumps(data))
  steps, arms = bench_data.engine_cases(str(path))
  assert steps == []  # one table for two drafters: not attributable
  by = {c.name.split()[-1]: c for c in arms}
  assert by["spec_static"].drafter == "eagle3" and by["spec_static"].config.draft_len == 2
  assert by["ngram_adaptive"].drafter == "ngram" and by["ngram_adaptive"].config.adaptive
  assert not by["ngram_adaptive"].config.windowed  # its segments ran without a window
  lengths = np.array(by["ar_static"].lengths)
  assert lengths.min() == pytest.approx(10) and lengths.max() == pytest.approx(100)
  for c in arms:
    assert c.predict(CPU_EFF) > 0


# -- specjax-continuous: queue-fed row slots over paged KV (continuous_model.py) -----------------

def _lognormal(n, mean, sigma, cap):
  w = Workload(name="t", prompts=1, samples=n, mean_response_len=mean, max_response_len=cap,
               length_sigma=sigma)
  return np.round(w.response_lengths(n))[phases._queue_order(n)]


def _paged_cost(bucket, k, kv):
  return 1e-3 + 1e-5 * bucket * (k + 1) + 1e-7 * kv  # weights + per-slot work + pages read


def _prefill_cost(rows, tokens, kv, queries):
  return 1e-4 + 2e-6 * tokens


def test_paged_rows_held_ignore_max_length_while_dense_rows_per_wave_shrink():
  hw, eff, m = get_hardware("h100"), Efficiency(), get_model("qwen3-8b")
  held, dense = [], []
  for cap in (4096, 16384):  # lengths far below both caps: the same actual lengths
    w = Workload(name="t", prompts=16, samples=16, prompt_len=128, mean_response_len=400.0,
                 max_response_len=cap, length_sigma=0.5)
    cont = phases.generation_continuous(m, hw, eff, 1, w, mp=1)
    held.append((cont.slots, cont.engine_stats["peak_live"]))
    dense.append(phases.generation_specjax(m, hw, eff, 1, w, mp=1).slots)
  assert held[0] == held[1] == (256, 256)
  assert dense[1] < dense[0] < held[0][0]
  lengths = _lognormal(96, 300.0, 0.9, 4096)
  peaks = [simulate_continuous(ContinuousEngineConfig(
      batch=96, prompt_len=64, max_new=cap, num_pages=2200, page_size=16, group_size=8),
      lengths, [], _paged_cost, _prefill_cost).peak_live for cap in (4096, 16384)]
  assert peaks[0] == peaks[1]


def test_paged_engine_holds_at_least_the_dense_rows_at_the_same_budget():
  hw, eff, m = get_hardware("h100"), Efficiency(), get_model("qwen3-8b")
  w = Workload(name="t", prompts=64, samples=16, prompt_len=256, mean_response_len=1500.0,
               max_response_len=16384, length_sigma=1.2)  # long tail: a few rows reach 16k
  cont = phases.generation_continuous(m, hw, eff, 1, w, mp=1)
  dense = phases.generation_specjax(m, hw, eff, 1, w, mp=1)
  assert cont.engine_stats["peak_live"] >= cont.slots > 4 * dense.slots
  assert cont.seconds < dense.seconds


def test_refill_between_segments_is_never_slower_than_waves():
  lengths = _lognormal(256, 400.0, 1.0, 4096)
  runs = {f: simulate_continuous(ContinuousEngineConfig(
      batch=32, prompt_len=64, max_new=4096, group_size=8, refill_fraction=f,
      refill_overhead_s=2e-3), lengths, [], _paged_cost, _prefill_cost)
      for f in (1 / 32, 0.125, 0.5, 1.0)}  # 1.0: refill only when every slot is free = waves
  assert all(r.seconds <= runs[1.0].seconds for r in runs.values())
  assert runs[0.125].seconds < 0.6 * runs[1.0].seconds  # the tail of each wave overlaps
  assert runs[1 / 32].refills > runs[0.125].refills > runs[1.0].refills
  for r in runs.values():  # every row's tokens, each committed once
    assert r.tokens == pytest.approx((lengths - 1).sum())


def test_refills_chosen_from_costs_follow_the_refill_overhead_and_keep_up_with_the_best_fraction():
  """The engine's default rule (`adaptive.best_refill`) in the model: a dear refill makes it
  wait for more free slots; it keeps within a few percent of the best fixed fraction at each
  refill cost (which no single fraction does) and beats the default 1/8 where a refill is
  dear."""
  lengths = _lognormal(256, 400.0, 1.0, 4096)
  cfg = ContinuousEngineConfig(batch=32, prompt_len=64, max_new=4096, group_size=8)
  run = lambda **kw: simulate_continuous(dataclasses.replace(cfg, **kw), lengths, [],
                                         _paged_cost, _prefill_cost)
  fixed = {o: {f: run(refill_fraction=f, refill_overhead_s=o).seconds
               for f in (1 / 32, 0.125, 0.5)} for o in (1e-4, 0.05, 0.2)}
  costs = {o: run(refill_from_costs=True, refill_overhead_s=o) for o in fixed}
  assert costs[1e-4].refills > costs[0.05].refills > costs[0.2].refills
  for o, r in costs.items():
    assert r.seconds <= 1.05 * min(fixed[o].values()), o
  assert costs[0.2].seconds < 0.8 * fixed[0.2][0.125]
  cheap, dear = costs[1e-4], costs[0.2]
  for r in (cheap, dear):  # every row's tokens, each committed once
    assert r.tokens == pytest.approx((lengths - 1).sum())


def test_preemption_never_loses_tokens_and_counts_the_recomputation():
  lengths = _lognormal(64, 600.0, 0.9, 4096)
  rates = engine_model.cumulative_rates(2.5, 3)
  cfg = ContinuousEngineConfig(batch=64, prompt_len=64, max_new=4096, draft_len=3,
                               max_draft_len=3, page_size=16, group_size=8)
  tight = simulate_continuous(dataclasses.replace(cfg, num_pages=600), lengths, rates,
                              _paged_cost, _prefill_cost)
  ample = simulate_continuous(dataclasses.replace(cfg, num_pages=100000), lengths, rates,
                              _paged_cost, _prefill_cost)
  assert ample.preemptions == 0 and ample.recomputed_tokens == 0
  assert tight.preemptions > 0 and tight.recomputed_tokens > 0
  assert 0 < tight.recompute_s < tight.prefill_s
  assert tight.peak_pages <= 600
  for r in (tight, ample):
    assert r.tokens == pytest.approx((lengths - 1).sum())
  assert tight.seconds > ample.seconds


def test_continuous_engine_closes_the_dense_cache_gap_at_the_published_8b_point():
  base = Scenario(workload=get_workload("rl-zero"), gen_mp=1)
  vllm = compare(base)
  dense = compare(base.replace(engine="specjax"))
  cont = compare(base.replace(engine="specjax-continuous", adaptive=True))
  assert dense.ar.gen > 2 * vllm.ar.gen  # 57 dense rows per wave vs 128 paged rows
  assert cont.ar.gen <= 1.1 * vllm.ar.gen
  assert cont.spec.gen <= 1.02 * vllm.spec.gen
  assert cont.spec.gen_detail.engine_stats["preemptions"] == 0


def test_continuous_engine_config_rejects_bad_values_naming_the_field():
  with pytest.raises(ValueError, match="ContinuousEngineConfig.refill_fraction"):
    ContinuousEngineConfig(batch=8, prompt_len=8, max_new=16, refill_fraction=0.0)
  with pytest.raises(ValueError, match="ContinuousEngineConfig.num_pages"):
    ContinuousEngineConfig(batch=8, prompt_len=64, max_new=1024, num_pages=8, page_size=16)
  with pytest.raises(ValueError, match="Scenario.refill_fraction"):
    Scenario(engine="specjax-continuous", refill_fraction=1.5)
  assert Scenario(engine="specjax-continuous", adaptive=True).adaptive
