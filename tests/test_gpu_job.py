"""The main job's GPU configuration (experiments/configs/rl_zero_gpu.yaml) at tiny shapes on the
CPU (`--smoke`): every stage, the paged queue, the head's online loss, the device figures and
the time budget run here before a GPU runs them at size."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CONFIG = os.path.join(ROOT, "experiments", "configs", "rl_zero_gpu.yaml")


def test_the_gpu_config_names_the_real_model_shape_and_the_rl_batch():
  import rl_zero
  from specjax.jobs.config import parse_config

  cfg = parse_config(rl_zero.DEFAULTS, ["--config", GPU_CONFIG])
  m = cfg.rl.model
  assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_hidden) \
      == (28, 2048, 16, 8, 128, 6144)  # the body of Qwen3-1.7B
  assert (m.dtype, cfg.rl.rollout.gen_dtype) == ("bfloat16", "bfloat16")
  assert (cfg.rl.prompts_per_step, cfg.rl.grpo.group_size) == (32, 8)
  assert cfg.rl.rollout.max_new_tokens >= 1024 and cfg.rl.task.name == "trace-long"
  assert cfg.rl.rollout.engine.paging.kv_cache_gb > 0 and cfg.rl.rollout.engine.adaptive.enabled
  assert cfg.rl.draft.kind == "eagle3" and cfg.rl.draft.online
  assert 0 < cfg.budget_s <= 8 * 60


@pytest.mark.slow
def test_the_gpu_config_runs_at_tiny_shapes_and_its_budget_ends_both_arms_after_the_same_step(
    tmp_path):
  import rl_zero

  out = tmp_path / "runs" / "rl_zero_gpu"
  # a budget spent from the start: both arms stop after the two steps they always take (of 3)
  summary = rl_zero.main(["--config", GPU_CONFIG, "--smoke", "--budget-s", "0.001",
                          "--out-dir", str(tmp_path / "runs"), "--cache-dir",
                          str(tmp_path / "cache")])
  on_disk = json.loads((out / "summary.json").read_text())
  assert on_disk["budget_stopped_after_steps"] == 2
  for arm in ("ar", "spec"):
    records = [json.loads(line) for line in (out / arm / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r]
    assert [r["step"] for r in steps] == [1, 2], arm
    assert [r["step"] for r in records if r.get("event") == "budget"] == [2], arm
    segments = [r for r in records if r.get("event") == "engine_segment"]
    assert any(s["pages_in_use"] > 0 for s in segments), f"{arm}: paged KV memory"
    assert any(s["refill_at"] > 0 for s in segments), f"{arm}: the queue refills its slots"
    # compiling is the first step's, every later step loads nothing new
    assert steps[0]["perf/compile_s"] > 0 and steps[1]["perf/compile_s"] < steps[0]["perf/compile_s"]
    device = on_disk["runs"][arm]["device"]
    assert device["device_kind"] and device["first_step_compile_s"] > 0
    assert 0 < device["gen_share_of_step"] < 1
    assert device["train_mfu"] is None  # no bf16 peak for a CPU; the rate is still measured
  spec = on_disk["runs"]["spec"]
  assert spec["acceptance_length_mean"] is not None
  assert spec["device"]["train_model_tflops_per_s"] > 0  # the online head's step trains all rows
  assert "device_note" in on_disk and summary["runs"]["ar"]["steps"] == 2
  assert (out / "spec" / "draft_hf" / "model.safetensors").exists()
