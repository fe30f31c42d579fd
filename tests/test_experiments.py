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
        "--rl.model.hidden-size", "32", "--rl.model.num-layers", "4", "--rl.model.mlp-hidden", "64",
        "--rl.model.aux-layers", "1", "2", "3", "--base.pretrain-layers", "2",
        "--base.pretrain-mlp-hidden", "32", "--rl.task.operands", "3",
        "--rl.rollout.max-new-tokens", "18",
        # one live-batch bucket (8 rows): adaptive K still runs; compaction is test_engine's and
        # test_rl_loop's, and each smaller bucket would add programs to compile and calibrate
        "--rl.rollout.engine.buckets.min-bucket", "8"]


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
  for key in ("rollout_speedup", "step_speedup", "final_val_accuracy", "final_accuracy_note",
              "runs", "initial_validation"):
    assert key in on_disk
  assert "agreement_test" not in on_disk and "p_value" not in json.dumps(on_disk)
  assert on_disk["runs"]["spec"]["acceptance_length"], "the spec run logs acceptance length"
  assert summary["runs"]["ar"]["steps"] == 2
  # the arms took turns: AR step 1, spec step 1, AR step 2, spec step 2
  ends = {arm: [r["perf/wall_clock"] for r in map(json.loads, (out / arm / "metrics.jsonl")
                                                  .read_text().splitlines()) if "time/step" in r]
          for arm in ("ar", "spec")}
  assert ends["ar"][0] < ends["spec"][0] < ends["ar"][1] < ends["spec"][1], ends
  # the run's trained head, in the community format, has a Llama layer (no q/k norm, though the
  # policy is Qwen3-shaped): vLLM and SGLang load it
  from safetensors.numpy import load_file
  head = load_file(str(out / "spec" / "draft_hf" / "model.safetensors"))
  assert "midlayer.self_attn.q_proj.weight" in head
  assert not [name for name in head if "q_norm" in name or "k_norm" in name]
  # a second run finds the cached base policy and draft head
  cached = sorted(os.listdir(tmp_path / "cache"))
  assert any(c.startswith("base-") for c in cached) and any(c.startswith("eagle3-") for c in cached)


@pytest.mark.slow
def test_rl_think_through_the_seeds_script_fine_tunes_a_scratchpad_model_and_runs_both_arms(
    tmp_path):
  import rl_zero_seeds

  out = tmp_path / "runs"
  result = rl_zero_seeds.main(["--experiment", "rl_think", "--seeds", "0", "--out-dir", str(out),
                               "--cache-dir", str(tmp_path / "cache"),
                               "--base.finetune-steps", "3"] + TINY)
  assert result["experiment"] == "rl_think" and result["seeds"] == [0]
  assert json.loads((out / "rl_think_seeds.json").read_text()) == result
  run = json.loads((out / "rl_think_seed0" / "summary.json").read_text())
  assert sorted(run["runs"]) == ["ar", "spec"] and run["config"]["base"]["finetune_steps"] == 3


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
  from specjax.errors import UserError
  from specjax.jobs.config import BaseModelConfig, ExperimentConfig, parse_config

  with pytest.raises(ValueError, match="BaseModelConfig.bias"):
    BaseModelConfig(bias=1.5)
  with pytest.raises(UserError, match="--config: .*missing.yaml does not exist"):
    parse_config(ExperimentConfig(), ["--config", str(tmp_path / "missing.yaml")])
  yaml_file = tmp_path / "bad.yaml"
  yaml_file.write_text("rl:\n  stepz: 3\n")
  with pytest.raises(ValueError, match="stepz"):
    parse_config(ExperimentConfig(), ["--config", str(yaml_file)])
  good = tmp_path / "good.yaml"
  good.write_text("rl:\n  steps: 3\n  draft:\n    draft_len: 5\n")
  cfg = parse_config(ExperimentConfig(), ["--config", str(good), "--rl.seed", "7"])
  assert (cfg.rl.steps, cfg.rl.draft.draft_len, cfg.rl.seed) == (3, 5, 7)


def test_growth_keeps_the_small_decoders_logits_and_every_new_weight_gets_gradient():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from specjax.jobs.grow import grow_decoder
  from specjax.models import Decoder, ModelConfig

  small = Decoder(ModelConfig(num_layers=2, mlp_hidden=32), rngs=nnx.Rngs(1))
  big = grow_decoder(small, small.cfg.replace(num_layers=4, mlp_hidden=96, aux_layers=(1, 2, 3)),
                     seed=2)
  x = jnp.asarray(np.random.default_rng(0).integers(3, 60, (2, 12)), jnp.int32)
  np.testing.assert_allclose(big(x).logits, small(x).logits, atol=1e-5)
  graphdef, params = nnx.split(big, nnx.Param)
  grads = jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(x).logits ** 2))(params)
  layers = grads["layers"]
  for i in (2, 3):  # appended identity layers: their zero output projections learn
    assert float(jnp.abs(layers[i]["attn"]["o_proj"][...]).max()) > 0
    assert float(jnp.abs(layers[i]["mlp"]["down"][...]).max()) > 0
  assert float(jnp.abs(layers[0]["mlp"]["down"][...][32:]).max()) > 0  # the new MLP units
  with pytest.raises(ValueError, match="ModelConfig.hidden_size"):
    grow_decoder(small, small.cfg.replace(hidden_size=128))
  with pytest.raises(ValueError, match="ModelConfig.num_layers"):
    grow_decoder(small, small.cfg.replace(num_layers=1))


def test_speedups_skip_steps_that_compiled_in_either_run():
  from specjax.jobs.report import compile_mask, paired_speedups

  def run(gens, compiled):
    return [{"step": i + 1, "time/gen": g, "time/step": g + 1.0, "perf/compile_step": c}
            for i, (g, c) in enumerate(zip(gens, compiled))]

  # a resumed AR run compiles again at step 3; the spec run's step 4 compiled (a later process)
  ar = run([9.0, 2.0, 2.0, 2.0], [True, False, True, False])
  spec = run([9.0, 1.0, 1.0, 50.0], [True, False, False, True])
  assert compile_mask(ar) == [True, False, True, False]
  assert compile_mask(spec) == [True, False, False, True]
  out = paired_speedups(ar, spec)
  assert out["speedup_steps"] == [2] and out["rollout_speedup"] == 2.0
  assert out["step_speedup"] == 3.0 / 2.0
  assert "train_rows_ratio" not in out  # runs that logged no packed rows
  for records, rows in ((ar, [3, 2, 1, 1]), (spec, [9, 3, 1, 1])):
    for r, n in zip(records, rows):
      r["train/packed_rows"] = float(n)
  assert paired_speedups(ar, spec)["train_rows_ratio"] == 1.5  # over step 2 only
  # the spec run's completions grew shorter: half the time for a quarter of the tokens is half
  # AR's tokens/s
  for records, tokens in ((ar, [50, 400, 400, 400]), (spec, [50, 100, 100, 100])):
    for r, n in zip(records, tokens):
      r["gen/tokens"] = float(n)
  out = paired_speedups(ar, spec)
  assert out["gen_tokens_ratio"] == 0.25 and out["rollout_tokens_per_s_speedup"] == 0.5


def test_seed_summary_reports_mean_spread_and_an_exact_paired_test():
  import rl_zero_seeds

  def summary(ar, spec):
    return {"initial_validation": {"val/accuracy": 0.1}, "rollout_speedup": 1.5,
            "step_speedup": 1.1, "acceptance_length": 2.4,
            "runs": {"ar": {"final_val_accuracy": ar}, "spec": {"final_val_accuracy": spec}}}

  out = rl_zero_seeds.summarize({0: summary(0.5, 0.6), 1: summary(0.3, 0.4), 2: summary(0.4, 0.5)})
  assert abs(out["arms"]["ar"]["final_accuracy"]["mean"] - 0.4) < 1e-9
  assert abs(out["arms"]["spec"]["gain"]["mean"] - 0.4) < 1e-9
  assert abs(out["arms"]["ar"]["final_accuracy"]["std"] - 0.1) < 1e-9
  t = out["paired_test"]
  assert t["p_value"] == 0.25 == t["min_possible_p"] and t["agree_at_0.05"]  # 3 seeds: p >= 1/4
  assert rl_zero_seeds.sign_flip_test([0.1, -0.1, 0.0]) == 1.0


def test_gpu_benchmark_runs_every_stage_at_smoke_size_and_writes_json(tmp_path):
  """The GPU benchmark is run on the day a GPU is lent: its every stage must already work (here at
  tiny shapes on the CPU), its kernel checks must pass, and its drafts must be accepted by
  construction."""
  import bench_gpu

  out = tmp_path / "gpu.json"
  bench_gpu.main(["--smoke", "--batches", "2", "--out", str(out)])
  data = json.loads(out.read_text())
  (row,) = data["decode"]["smoke"]
  assert row["batch"] == 2 and row["steps"] == 7 and row["step_ms"] > 0  # the prefill emits 1 of 8
  assert 0 < row["roof_fraction"] and row["step_gbytes"] > 0
  assert len(row["calls_s"]) == 2 and row["call_s"] == min(row["calls_s"])  # --repeats 2
  (ctx,) = data["context"]["smoke"]  # the same step over long prompts
  assert ctx["prompt_len"] == 24 and ctx["context_len"] == 24 + 4 and ctx["step_ms"] > 0
  assert ctx["step_gbytes"] > row["step_gbytes"]
  paged = data["paged"]  # the Pallas kernel in interpret mode here
  assert paged["interpret"] and len(paged["checks"]) == 8
  for check in paged["checks"]:
    assert check["max_abs_err"] < (1e-5 if check["dtype"] == "float32" else 3e-2), check
    assert check["padding_row_zero"]
  assert {"pallas", "reference", "chunked", "pallas_p4_wdefault_s1",
          "pallas_p1_wdefault_s4"} <= set(paged["timings"][0])
  # 1 and 4 pages per loop step, a row's pages split over 1 and 4 programs
  assert {(c["pages_per_block"], c["num_splits"]) for c in paged["launch_checks"]} == {
      (1, 1), (1, 4), (4, 1), (4, 4)}
  for check in paged["launch_checks"]:
    assert check["max_abs_err"] < 3e-2, check
  assert paged["engine_greedy"]["rows_identical"] == paged["engine_greedy"]["rows"] == 16
  (reads,) = data["reads"]["rows"]  # whole and chunked dense-cache reads, side by side
  assert reads["whole"]["step_ms"] > 0 and reads["chunked"]["step_ms"] > 0
  assert reads["whole"]["forward_ms"] > 0 and reads["chunked"]["forward_ms"] > 0
  assert reads["chunked"]["attention_loops"] and not reads["whole"]["attention_loops"]
  arms = data["speculative"]["rows"][0]["arms"]
  assert set(arms) == {"ar", "spec_static", "spec_adaptive", "spec_tree_static",
                       "spec_tree_d1_static"}
  # layers past the draft's have zero output projections: the draft model is the target (K = 2 at
  # smoke size: every draft accepted, 3 tokens a step)
  assert arms["spec_static"]["acceptance_length"] == pytest.approx(3.0)
  for tree in ("spec_tree_static", "spec_tree_d1_static"):
    assert arms[tree]["acceptance_length"] == pytest.approx(3.0)
    assert arms[tree]["step_ms"] > 0
  queue = data["queue"]  # 6 prompts x 2 samples on 4 slots; half the slots' KV as the budget
  assert set(queue["arms"]) == {"waves", "continuous", "continuous_spec", "dense", "paged",
                                "paged_spec", "paged_tuned"}
  tuned = queue["arms"]["paged_tuned"]  # the paged stage's fastest
  assert tuned["kernel_pages"] in (1, 4) and tuned["kernel_splits"] in (1, 4)
  assert queue["rows"] == 12 and queue["kv_budget_dense_rows"] == 2
  for name, rec in queue["arms"].items():
    assert rec["tokens_per_s"] > 0 and rec["tokens"] > 0 and rec["rows_max"] <= 4, name
    assert 0 < rec["segments_s"] < rec["call_s"], name  # the rest: prefills, admissions, ...
    assert rec["outside_segments_s"] == pytest.approx(rec["call_s"] - rec["segments_s"])
    assert (rec["refills"] > 0) == (name != "waves"), name  # 12 rows on at most 4 slots
  assert queue["arms"]["dense"]["rows_max"] <= 2  # its slots are the budget's rows
  # (whether the adaptive engine drafts at all follows its measured step costs: machine load)
  assert "acceptance_length" in queue["arms"]["continuous_spec"]
  assert "acceptance_length" in queue["arms"]["paged_spec"]
  assert queue["arms"]["paged_spec"]["pages_in_use_max"] > 0
  assert "skipped" not in data


@pytest.mark.parametrize("tied", [True, False])
def test_weight_chain_reads_each_matrix_a_decode_step_multiplies_by_once(tied):
  """The bare chain beside the decode step (peer_vllm, bench_engine's roof) reads what a step
  multiplies by: every weight matrix, the tied embedding as the LM head; an untied embedding is
  only gathered, so it is left out."""
  import bench_engine
  import jax
  from flax import nnx

  from specjax.models import Decoder, ModelConfig

  model = Decoder(ModelConfig(tie_embeddings=tied), rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  mats = {jax.tree_util.keystr(p): w
          for p, w in jax.tree_util.tree_leaves_with_path(params) if w.ndim >= 2}
  expected = sum(w.nbytes for k, w in mats.items() if tied or "embed" not in k)
  per_pass, nbytes = bench_engine.weight_chain(params, rows=3, steps=2)
  assert nbytes == expected and per_pass() > 0


def test_the_report_shows_both_accuracies_and_runs_no_test_between_one_runs_arms(tmp_path):
  """One run's two arms are two policies: the report gives each arm's final accuracy and says
  where losslessness and agreement over seeds are checked, with no p-value of its own."""
  import dataclasses
  import re

  from specjax.jobs.report import ARMS_NOTE, format_table, write_report

  @dataclasses.dataclass
  class Cfg:
    name: str = "toy"

  results = {}
  for arm, acc in (("ar", 0.9), ("spec", 0.3)):  # far apart: a one-run test would reject
    os.makedirs(tmp_path / arm)
    path = tmp_path / arm / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "time/step": 2.0, "time/gen": 1.0,
                                        "perf/compile_step": s == 1, "val/accuracy": acc}) + "\n"
                            for s in (1, 2)))
    results[arm] = {"metrics_path": str(path)}
  summary = write_report(Cfg(), str(tmp_path), results, wall_s=1.0)
  on_disk = json.loads((tmp_path / "summary.json").read_text())
  assert on_disk["final_val_accuracy"] == {"ar": 0.9, "spec": 0.3}
  assert "agreement_test" not in on_disk and "p_value" not in json.dumps(on_disk)
  text = format_table(summary)
  assert "two policies" in text and "rl_zero_seeds.py" in text, text
  assert "p =" not in text and "DIFFER" not in text and "agree at" not in text, text
  root = os.path.join(os.path.dirname(__file__), "..")
  named = re.findall(r"[\w/]+\.py", " ".join(ARMS_NOTE))  # the files the note points to exist
  assert len(named) == 4 and all(os.path.exists(os.path.join(root, p)) for p in named), named
  assert "two policies" not in format_table({"runs": {}})  # one arm alone: nothing to compare


@pytest.mark.slow
def test_rl_real_runs_both_arms_on_a_gguf_file_with_word_problems(tmp_path):
  """experiments/rl_real.py's path on a tiny GGUF file the tests write (the real model's run is
  the same command without --model-path)."""
  import rl_real
  from flax import nnx
  from test_gguf import CFG, write_gguf
  from specjax.models import Decoder

  path = tmp_path / "tiny.gguf"
  write_gguf(path, Decoder(CFG, rngs=nnx.Rngs(0)))
  summary = rl_real.main([
      "--model-path", str(path), "--out-dir", str(tmp_path / "runs"),
      "--cache-dir", str(tmp_path / "cache"), "--rl.steps", "1", "--rl.prompts-per-step", "2",
      "--rl.grpo.group-size", "2", "--rl.rollout.max-new-tokens", "6",
      "--rl.rollout.max-prompt-len", "256", "--rl.validation.every", "0", "--rl.no-progress",
      "--rl.no-tensorboard", "--rl.rollout.engine.buckets.min-bucket", "4"])
  assert set(summary["runs"]) == {"ar", "spec"}
  assert summary["runs"]["spec"]["acceptance_length"]
  assert (tmp_path / "runs" / "rl_real" / "summary.json").exists()
