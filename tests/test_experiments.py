"""The main jobs end to end at toy size: every stage runs and the report is written."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))

TINY = ["--base.steps", "4", "--base.examples", "64", "--base.batch-size", "16",
        "--draft-init.steps", "3", "--draft-init.prompts", "16", "--draft-init.batch-size", "8",
        "--rl.steps", "2", "--rl.prompts-per-step", "2", "--rl.grpo.group-size", "4",
        "--rl.validation.every", "2", "--rl.validation.num-prompts", "8",
        "--rl.validation.batch-size", "8", "--rl.no-progress", "--rl.no-tensorboard",
        "--rl.model.hidden-size", "32", "--rl.model.num-layers", "3", "--rl.model.mlp-hidden", "64"]


@pytest.mark.slow
def test_rl_zero_runs_every_stage_and_writes_the_report(tmp_path):
  import rl_zero

  args = ["--out-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache")] + TINY
  summary = rl_zero.main(args)
  out = tmp_path / "runs" / "rl_zero"
  for name in ("summary.json", "val_accuracy.png", "acceptance_length.png", "phase_times.png",
               "ar/metrics.jsonl", "spec/metrics.jsonl"):
    assert (out / name).exists(), name
  on_disk = json.loads((out / "summary.json").read_text())
  for key in ("rollout_speedup", "step_speedup", "agreement_test", "runs", "initial_validation"):
    assert key in on_disk
  assert on_disk["runs"]["spec"]["acceptance_length"], "the spec run logs acceptance length"
  assert summary["runs"]["ar"]["steps"] == 2
  # a second run finds the cached base policy and draft head
  cached = sorted(os.listdir(tmp_path / "cache"))
  assert any(c.startswith("base-") for c in cached) and any(c.startswith("eagle3-") for c in cached)


@pytest.mark.slow
def test_rl_think_fine_tunes_a_scratchpad_model_and_runs_spec_rl(tmp_path):
  import rl_think

  args = ["--out-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache"),
          "--base.finetune-steps", "3", "--no-compare"] + TINY
  summary = rl_think.main(args)
  assert list(summary["runs"]) == ["spec"]
  assert (tmp_path / "runs" / "rl_think" / "summary.json").exists()


def test_scratchpad_task_writes_partial_results_and_scores_the_final_answer():
  import rl_think
  from specjax.rl.config import TaskConfig

  task = rl_think.ScratchpadArithmeticTask(TaskConfig(name="arithmetic-think", digits=2,
                                                      operands=3, operators="+-"))
  e = task.example(0)
  pad = task.scratchpad(e)
  assert pad.endswith("#" + e.answer) and pad.count("=") == 2
  assert task.score(pad, e).correct
  assert not task.score(pad.rsplit("#", 1)[0] + "#" + str(int(e.answer) + 1), e).correct
  assert not task.score("no answer", e).correct
  with pytest.raises(ValueError, match="operators"):
    rl_think.ScratchpadArithmeticTask(TaskConfig(operators="*"))


def test_bad_experiment_config_is_a_clear_error(tmp_path):
  from specjax.experiment.driver import BaseModelConfig, ExperimentConfig, parse_config

  with pytest.raises(ValueError, match="BaseModelConfig.bias"):
    BaseModelConfig(bias=1.5)
  with pytest.raises(FileNotFoundError, match="--config"):
    parse_config(ExperimentConfig(), ["--config", str(tmp_path / "missing.yaml")])
  yaml_file = tmp_path / "bad.yaml"
  yaml_file.write_text("rl:\n  stepz: 3\n")
  with pytest.raises(ValueError, match="stepz"):
    parse_config(ExperimentConfig(), ["--config", str(yaml_file)])
  good = tmp_path / "good.yaml"
  good.write_text("rl:\n  steps: 3\n  draft:\n    draft_len: 5\n")
  cfg = parse_config(ExperimentConfig(), ["--config", str(good), "--rl.seed", "7"])
  assert (cfg.rl.steps, cfg.rl.draft.draft_len, cfg.rl.seed) == (3, 5, 7)
