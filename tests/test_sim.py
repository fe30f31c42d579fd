"""Tests of the performance simulator: limits, monotonicity, calibration against the paper, CLI.

Pure numpy (no jax); every test runs in well under a second.
"""

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from specjax.sim import bench_data, calibrate, catalog, cost
from specjax.sim.catalog import get_hardware, get_model
from specjax.sim.factors import efficiency_for
from specjax.sim.simulate import Scenario, compare, simulate_step
from specjax.sim.workload import Workload, get_workload

SHORT = Workload(name="short", prompts=64, samples=16, prompt_len=128, mean_response_len=300.0,
                 max_response_len=1024, acceptance_length=2.5)
DRAFTERS = ("eagle3", "mtp", "draft-model", "ngram")


@pytest.fixture(scope="module")
def paper():
  eff = efficiency_for("gb200")
  return {c.name: (c, c.predict(eff)) for c in calibrate.paper_cases()}


def test_published_architectures_give_published_parameter_counts():
  expect = {"qwen3-0.6b": (0.6e9, None), "qwen3-8b": (8.19e9, None),
            "qwen3-32b": (32.8e9, None), "qwen3-30b-a3b": (30.5e9, 3.3e9),
            "qwen3-235b-a22b": (235e9, 22e9), "llama-3.1-8b": (8.03e9, None),
            "llama-3.1-70b": (70.6e9, None)}
  for name, (total, active) in expect.items():
    m = get_model(name)
    assert m.num_params == pytest.approx(total, rel=0.02), name
    if active:  # published active counts include the input embedding
      assert m.active_params + m.embed_params == pytest.approx(active, rel=0.03), name


def test_zero_draft_len_equals_autoregressive():
  m, hw, eff = get_model("qwen3-8b"), get_hardware("gb200"), efficiency_for("gb200")
  rows, kv = np.array([1.0, 64.0, 512.0]), np.array([1e3, 2e5, 3e6])
  for d in DRAFTERS:
    spec = cost.spec_step_time(m, hw, eff, 1, rows, kv, 0, 1.0, d, get_model("qwen3-0.6b"))
    np.testing.assert_allclose(spec, cost.ar_step_time(m, hw, eff, 1, rows, kv))
  s = Scenario(workload=SHORT, gpus=8)
  assert simulate_step(s.replace(draft_len=0)).step == simulate_step(s.replace(drafter="none")).step


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_acceptance_length_one_gives_speedup_below_one(drafter):
  c = compare(Scenario(workload=SHORT, gpus=8, drafter=drafter, acceptance_length=1.0))
  assert c.rollout_speedup < 1.0 and c.step_speedup < 1.0


def test_speedup_falls_as_batch_per_gpu_grows_at_fixed_acceptance():
  speedups = [compare(Scenario(workload=SHORT.replace(prompts=p), gpus=8, gen_mp=1)
                      ).rollout_speedup for p in (4, 16, 64, 256, 1024)]
  assert all(a >= b for a, b in zip(speedups, speedups[1:])), speedups
  assert speedups[0] > 1.4 and speedups[-1] < 1.0, speedups


def test_more_bandwidth_never_slows_a_memory_bound_phase(tmp_path):
  path = tmp_path / "hw.yaml"
  path.write_text("hardware:\n" + "".join(
      f"  bw{x}:\n    flops: 989e12\n    hbm_bw: {3.35e12 * x}\n    hbm_bytes: 80e9\n"
      f"    nvlink_bw: 900e9\n    net_bw: 50e9\n    domain: 8\n" for x in (1, 2, 4)))
  names, _ = catalog.load_catalog(str(path))
  assert names == ["bw1", "bw2", "bw4"]
  for drafter in ("none", "eagle3"):
    gens = [simulate_step(Scenario(workload=SHORT, gpus=8, hardware=n, drafter=drafter,
                                   efficiency=efficiency_for("gb200"))).gen for n in names]
    assert gens[0] >= gens[1] >= gens[2], gens
  m, eff = get_model("qwen3-8b"), efficiency_for("gb200")
  times = [cost.ar_step_time(m, get_hardware(n), eff, 1, 64.0, 64 * 8e3) for n in names]
  assert times[0] > times[1] > times[2]


@pytest.mark.parametrize("model,hardware,gpus", [("qwen3-8b", "gb200", 32),
                                                 ("qwen3-32b", "h100", 64),
                                                 ("qwen3-235b-a22b", "gb200", 256)])
def test_async_step_time_is_at_most_sync_step_time(model, hardware, gpus):
  for drafter in ("none", "eagle3"):
    s = Scenario(model=model, hardware=hardware, gpus=gpus, drafter=drafter)
    sync = simulate_step(s).step
    lag1 = simulate_step(s.replace(mode="async", policy_lag=1)).step
    lag2 = simulate_step(s.replace(mode="async", policy_lag=2)).step
    assert lag2 <= lag1 <= sync, (drafter, sync, lag1, lag2)


def test_async_step_is_the_slower_group_plus_what_stays_exposed():
  r = simulate_step(Scenario(mode="async", policy_lag=1, gen_fraction=0.5))
  assert r.gen_gpus + r.train_gpus == 32
  assert r.step == pytest.approx(max(r.gen, r.logprob + r.train) + r.prepare + r.other)
  assert r.exposed_gen == pytest.approx(max(0.0, r.gen - r.logprob - r.train))


@pytest.mark.parametrize("case", [
    "rl-zero AR gen", "rl-zero AR step", "rl-zero eagle3 K=3 gen", "rl-zero eagle3 K=3 step",
    "rl-think AR gen", "rl-think eagle3 K=3 gen"])
def test_calibrated_8b_case_lands_within_10_percent_of_the_published_figure(paper, case):
  c, predicted = paper[case]
  assert abs(predicted / c.seconds - 1) < 0.10, (case, predicted, c.seconds)


@pytest.mark.parametrize("case", ["rl-think AR step (derived)",
                                  "rl-think eagle3 K=3 step (derived)"])
def test_derived_8b_step_lands_within_15_percent(paper, case):
  c, predicted = paper[case]
  assert abs(predicted / c.seconds - 1) < 0.15, (case, predicted, c.seconds)


def test_generation_is_65_to_72_percent_of_the_ar_step(paper):
  for wl in ("rl-zero", "rl-think"):
    gen = paper[f"{wl} AR gen"][1]
    step = paper[[k for k in paper if k.startswith(f"{wl} AR step")][0]][1]
    assert 0.65 <= gen / step <= 0.72, (wl, gen / step)


def test_draft_len_3_beats_5_beats_7_on_rl_think():
  s = Scenario(workload=get_workload("rl-think"), gen_mp=1)
  steps = [simulate_step(s.replace(draft_len=k)).step for k in (3, 5, 7)]
  assert steps[0] < steps[1] < steps[2], steps


def test_ngram_is_slower_than_autoregressive_despite_two_tokens_per_step():
  for wl in ("rl-zero", "rl-think"):
    c = compare(Scenario(workload=get_workload(wl), drafter="ngram", gen_mp=1))
    assert c.spec.acceptance_length >= 2.0 and c.rollout_speedup < 1.0, (wl, c.rollout_speedup)


def test_fit_recovers_known_factors_from_benchmark_json(tmp_path):
  truth = cost.Efficiency(bw=0.72, flops=0.42, step_overhead_s=2.5e-3)
  m, hw = get_model("qwen3-0.6b"), get_hardware("h100")
  results = []
  for batch in (1, 16, 256, 2048):
    for ctx in (128, 2048):
      for k in (0, 3):
        acc = 2.0 if k else 1.0
        probe = calibrate.DecodeProbe(m, hw, batch, ctx, "eagle3" if k else "none", k, acc)
        results.append({"batch": batch, "context_len": ctx, "drafter": probe.drafter,
                        "draft_len": k, "acceptance_length": acc,
                        "tokens_per_s": batch * acc / probe.predict(truth)})
  path = tmp_path / "bench.json"
  path.write_text(json.dumps({"hardware": "h100", "model": "qwen3-0.6b", "results": results}))
  cases = bench_data.cases_from_benchmark_json(str(path))
  start = truth.replace(bw=0.5, flops=0.6, step_overhead_s=1e-3)
  fit = calibrate.fit_efficiency(cases, start, fields=("bw", "flops", "step_overhead_s"),
                                 ridge=0.0)
  for f in ("bw", "flops", "step_overhead_s"):
    assert getattr(fit, f) == pytest.approx(getattr(truth, f), rel=0.02), f


def gpu_benchmark_json(truth, kind="NVIDIA H100 80GB HBM3", dtype="bfloat16") -> dict:
  """bench_gpu.py's JSON (the fields the calibration reads) with AR decode steps that `truth`
  predicts, plus a row that failed."""
  hw = get_hardware("h100")
  decode = {}
  for shape in ("qwen3-1.7b", "qwen3-8b"):
    rows = [{"batch": b, "step_ms": 1e3 * calibrate.DecodeProbe(get_model(shape), hw, b,
                                                                 128 + 64).predict(truth)}
            for b in (1, 64, 256)]
    decode[shape] = rows + [{"batch": 1024, "error": "RESOURCE_EXHAUSTED: out of memory"}]
  context = [{"batch": b, "context_len": 2048 + 64,  # the context stage's long prompts
              "step_ms": 1e3 * calibrate.DecodeProbe(get_model("qwen3-1.7b"), hw, b,
                                                     2048 + 64).predict(truth)}
             for b in (1, 64)]
  return {"device": {"platform": "gpu", "device_kind": kind},
          "args": {"prompt_len": 128, "new_tokens": 128, "dtype": dtype}, "decode": decode,
          "context": {"qwen3-1.7b": context}}


def test_gpu_benchmark_json_calibrates_its_hardware_and_names_what_it_cannot(tmp_path):
  truth = efficiency_for("gb200").replace(bw=0.8, flops=0.4, step_overhead_s=1.5e-3,
                                          logit_s=5e-11, kv_bw=0.5)
  path = tmp_path / "bench_gpu.json"
  path.write_text(json.dumps(gpu_benchmark_json(truth)))
  cases = bench_data.cases_from_benchmark_json(str(path))
  assert len(cases) == 8  # the failed rows are left out
  assert {c.probe.hardware.name for c in cases} == {"h100"}
  # decode: prompt + half the new tokens; the context stage's rows give their own
  assert sorted({c.probe.context_len for c in cases}) == [192.0, 2112.0]
  fields = calibrate.bench_fields(cases)
  assert fields == calibrate.BENCH_FIELDS + ("kv_bw",)  # a long cache constrains kv_bw
  assert calibrate.bench_fields([c for c in cases if c.probe.context_len < 1024]) == \
      calibrate.BENCH_FIELDS
  fit = calibrate.fit_efficiency(cases, efficiency_for("h100"), fields, ridge=0.0, iters=100)
  for f in fields:  # logit_s starts at 0 and kv_bw unset: the fit finds them from their bounds
    assert getattr(fit, f) == pytest.approx(getattr(truth, f), rel=0.03), f
  for bad, match in ((gpu_benchmark_json(truth, kind="cpu"), "device.device_kind"),
                     (gpu_benchmark_json(truth, dtype="float32"), "args.dtype")):
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match):
      bench_data.cases_from_benchmark_json(str(path))
  path.write_text(json.dumps(gpu_benchmark_json(truth)))  # the command line: before and after
  cli, buf = _cli(), io.StringIO()
  with contextlib.redirect_stdout(buf):
    cli.main(["--calibrate", "--bench-only", "--bench-json", str(path), "--json"])
  out = json.loads(buf.getvalue())
  assert out["hardware"] == "h100" and out["fields"] == list(fields)
  assert max(abs(r["error"]) for r in out["cases"]) < 0.01
  assert max(abs(r["error"]) for r in out["cases_before"]) > 0.05  # the inherited factors


def test_moe_forward_reads_more_experts_as_tokens_grow():
  net = cost.target_net(get_model("qwen3-235b-a22b"))
  b = net.weight_bytes(np.array([1.0, 8.0, 64.0, 4096.0]))
  assert np.all(np.diff(b) > 0)
  assert b[-1] == pytest.approx(get_model("qwen3-235b-a22b").weight_bytes, rel=0.01)


def test_configs_reject_bad_values_naming_the_field():
  with pytest.raises(ValueError, match="Scenario.mode"):
    Scenario(mode="pipelined")
  with pytest.raises(ValueError, match="Scenario.acceptance_length"):
    Scenario(draft_len=3, acceptance_length=5.0)
  with pytest.raises(ValueError, match="Workload.mean_response_len"):
    Workload(mean_response_len=20000.0, max_response_len=16384)
  with pytest.raises(ValueError, match="Efficiency.bw"):
    cost.Efficiency(bw=1.5)
  with pytest.raises(KeyError, match="unknown model"):
    Scenario(model="gpt-9")


def _cli():
  path = os.path.join(os.path.dirname(__file__), "..", "experiments", "simulate.py")
  spec = importlib.util.spec_from_file_location("simulate_cli", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_cli_json_prints_speedups_and_phase_seconds_for_both_rollouts(tmp_path):
  cli, buf = _cli(), io.StringIO()
  with contextlib.redirect_stdout(buf):
    cli.main(["--model", "qwen3-235b-a22b", "--hardware", "gb200", "--gpus", "512", "--mode",
              "sync", "--draft", "eagle3", "--draft-len", "3", "--acceptance-length", "3.0",
              "--json"])
  out = json.loads(buf.getvalue())
  assert out["rollout_speedup"] > 1 and out["step_speedup"] > 1
  for run in ("ar", "spec"):
    assert {"prepare", "gen", "logprob", "train", "step"} <= set(out[run])
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    cli.main(["--sweep", "draft-len", "--values", "0,3", "--out", str(tmp_path)])
  assert "draft_len" in buf.getvalue()
  assert any(p.endswith(".png") for p in os.listdir(tmp_path))


def test_simulator_never_imports_jax():
  code = "import sys, specjax.sim; assert 'jax' not in sys.modules, 'jax imported'"
  root = os.path.join(os.path.dirname(__file__), "..")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
