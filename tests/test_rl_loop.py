"""The synchronous RL loop end to end on the arithmetic task: learning, speculative rollouts with an
online EAGLE-3 draft, exact resume after an interruption, bad inputs."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from specjax.jobs.pretrain import pretrain_lm
from specjax.models import CharTokenizer, Decoder, ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.config import (CheckpointConfig, DraftConfig, RLConfig, RolloutConfig, TaskConfig,
                               TrainConfig, ValidationConfig, load_config)
from specjax.rl.grpo import GRPOConfig
from specjax.rl.loop import iterate_rl, run_rl
from specjax.rl.rollout import build_drafter
from specjax.rl.metrics_log import MetricsLogger, append_jsonl, read_metrics
from specjax.rl.tasks.arithmetic import ArithmeticTask

TOK = CharTokenizer()
MODEL = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, mlp_hidden=128)
CFG = RLConfig(
    model=MODEL, grpo=GRPOConfig(group_size=8),
    policy_optim=OptimConfig(lr=3e-4, warmup_steps=3),
    rollout=RolloutConfig(temperature=1.0, max_new_tokens=4), task=TaskConfig(digits=1),
    steps=30, prompts_per_step=8, progress=False, tensorboard=False,
    validation=ValidationConfig(every=30, num_prompts=100, batch_size=100),
    checkpoint=CheckpointConfig(save_on_exit=False, resume=False))


@pytest.fixture(scope="module")
def base_model():
  """A base policy that knows 1-digit sums but, like its SFT data, appends a spurious "0" to half
  of its answers: GRPO has to teach it to stop after the sum."""
  pairs = [(f"{a}+{b}=", str(a + b) + tail) for a in range(10) for b in range(10)
           for tail in ("", "0")]
  model, _ = pretrain_lm(Decoder(MODEL, rngs=nnx.Rngs(0)), pairs, TOK, steps=200, batch_size=32,
                         lr=3e-3)
  return nnx.split(model)


def _strip_times(records):
  return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in records]


def test_grpo_raises_the_arithmetic_reward_within_thirty_steps(base_model, tmp_path):
  cfg = CFG.replace(tensorboard=True)
  summary = run_rl(cfg, base_model, TOK, ArithmeticTask(cfg.task, TOK), out_dir=str(tmp_path),
                   verbose=False)
  records = read_metrics(summary["metrics_path"])
  assert [r["step"] for r in records] == list(range(1, 31))
  reward = np.array([r["reward/mean"] for r in records])
  # 64 samples per step, fixed seeds. Measured: last-10 minus first-10 mean reward +0.20 (0.36 ->
  # 0.56), greedy validation accuracy 0.96; with lr = 0 (no learning) -0.01 and 0.65.
  assert reward[-10:].mean() - reward[:10].mean() > 0.12, reward
  assert records[-1]["val/accuracy"] > 0.85
  assert max(r["mismatch/max_abs"] for r in records) < 1e-4  # sampler and trainer agree
  assert set(summary["phases"]["phases"]) == {"data", "prepare", "gen", "reward", "logprob",
                                              "train"}
  assert summary["steps"] == 30 and os.listdir(tmp_path / "tb")


def test_speculative_rollouts_with_an_online_eagle_draft_complete_and_log_acceptance(
    base_model, tmp_path):
  from specjax.drafters.head import init_head

  # sampled validation on 64 prompts reuses the rollouts' compiled speculative sampler
  # a fixed K (adaptive off): every step drafts, so acceptance is logged at every step; the
  # plain loop (no compaction): one program, the engine's buckets are test_engine's subject
  cfg = CFG.replace(steps=3, draft=DraftConfig(kind="eagle3", draft_len=2, online=True,
                                               ttt_steps=2),
                    rollout=dataclasses.replace(CFG.rollout, engine=CFG.rollout.engine.replace(
                        buckets=dict(compaction=False), adaptive=dict(enabled=False))),
                    draft_optim=OptimConfig(lr=1e-3),
                    validation=ValidationConfig(every=3, num_prompts=64, batch_size=64,
                                                greedy=False))
  head = init_head(MODEL, seed=0)
  head_init = [np.asarray(x) for x in jax.tree.leaves(nnx.state(head))]
  summary = run_rl(cfg, base_model, TOK, out_dir=str(tmp_path), draft=head, verbose=False)
  records = read_metrics(summary["metrics_path"])
  assert len(records) == 3
  for r in records:
    assert 1.0 <= r["spec/acceptance_length"] <= 3.0
    assert np.isfinite(r["draft/loss"]) and r["lr/draft"] > 0
  assert 1.0 <= records[-1]["val/acceptance_length"] <= 3.0
  trained = [np.asarray(x) for x in jax.tree.leaves(summary["state"].params["draft"])]
  assert any(np.any(a != b) for a, b in zip(trained, head_init)), "the draft did not learn"


def test_a_train_batch_cut_to_its_longest_row_trains_exactly_like_the_full_width(base_model,
                                                                                tmp_path):
  """Trimming the train batch (TrainConfig.width_block, packing off) leaves only padding
  out: the same update as training at prompt + max_new_tokens columns; each width compiles in
  the first step. Packing the sequences (the default) is the same update again, with nothing to
  warm up."""
  # the plain rollout loop (compaction changes no rollout, and its buckets would only compile)
  cfg = CFG.replace(steps=2, rollout=RolloutConfig(
      temperature=1.0, max_new_tokens=40,
      engine=RolloutConfig.engine.replace(buckets=dict(compaction=False))),
                    train=TrainConfig(width_block=8, packing=False),
                    validation=ValidationConfig())
  cut = run_rl(cfg, base_model, TOK, out_dir=str(tmp_path / "cut"), verbose=False)
  full = run_rl(cfg.replace(train=dataclasses.replace(cfg.train, width_block=0)),
                base_model, TOK, out_dir=str(tmp_path / "full"), verbose=False)
  packed = run_rl(cfg.replace(train=dataclasses.replace(cfg.train, packing=True)),
                  base_model, TOK, out_dir=str(tmp_path / "packed"), verbose=False)
  cut_rec, full_rec, packed_rec = (read_metrics(s["metrics_path"]) for s in (cut, full, packed))
  # 5-token prompts + 40 new tokens: 45 columns; "<bos>1+2=" and "12<eos>" fit in 8 or 16
  assert [r["train/width"] for r in full_rec] == [45, 45] == [r["train/width"] for r in packed_rec]
  assert all(r["train/width"] in (8, 16) for r in cut_rec), cut_rec
  for other in (cut_rec, packed_rec):
    for a, b in zip(other, full_rec):
      # packing leaves out zero-advantage sequences: entropy is then a mean over the others
      same_tokens = a.get("train/skipped_seqs", 0.0) == 0.0
      for k in ("pg_loss", "grad_norm/policy", "reward/mean") + ("entropy",) * same_tokens:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
  for run in (cut, packed):
    for x, y in zip(jax.tree.leaves(run["state"].params), jax.tree.leaves(full["state"].params)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
  assert "warm" in cut["phases"]["phases"]
  assert "warm" not in full["phases"]["phases"] and "warm" not in packed["phases"]["phases"]


def interrupt_at(step: int):
  """A hook that interrupts the run (as Ctrl-C would) once `step` is done."""
  def hook(done, metrics):
    if done == step:
      raise KeyboardInterrupt
  return hook


def test_resume_after_an_interruption_matches_an_uninterrupted_run(base_model, tmp_path):
  cfg = CFG.replace(checkpoint=CheckpointConfig(save_on_exit=True, resume=True))
  full = run_rl(cfg, base_model, TOK, out_dir=str(tmp_path / "full"), stop_after=4,
                verbose=False)

  with pytest.raises(KeyboardInterrupt):
    run_rl(cfg, base_model, TOK, out_dir=str(tmp_path / "split"), hooks=[interrupt_at(2)],
           verbose=False)
  assert sorted(os.listdir(tmp_path / "split" / "checkpoints")) == ["2"]
  resumed = run_rl(cfg, base_model, TOK, out_dir=str(tmp_path / "split"), stop_after=2,
                   verbose=False)
  assert resumed["start_step"] == 2 and resumed["steps"] == 4
  assert _strip_times(read_metrics(full["metrics_path"])) == \
      _strip_times(read_metrics(resumed["metrics_path"]))
  # a run taken a step at a time (the driver's interleaved arms) and closed after step 2 saves
  # like an interruption, and resumes the same way
  steps = iterate_rl(cfg, base_model, TOK, out_dir=str(tmp_path / "closed"), verbose=False)
  assert [next(steps)[0], next(steps)[0]] == [1, 2]
  steps.close()
  assert sorted(os.listdir(tmp_path / "closed" / "checkpoints")) == ["2"]
  resumed = run_rl(cfg, base_model, TOK, out_dir=str(tmp_path / "closed"), stop_after=2,
                   verbose=False)
  assert resumed["start_step"] == 2 and resumed["steps"] == 4
  assert _strip_times(read_metrics(full["metrics_path"])) == \
      _strip_times(read_metrics(resumed["metrics_path"]))
  for a, b in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(resumed["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_history_drafts_from_a_revisited_prompt_pool_and_resumes_exactly(base_model, tmp_path):
  """8 prompts revisited every step (TaskConfig.pool_size): from the second visit the history
  drafter has each prompt's earlier answers; the history travels in the checkpoint, so an
  interrupted run resumes as the uninterrupted one."""
  cfg = CFG.replace(steps=4, task=dataclasses.replace(CFG.task, pool_size=8),
                    draft=DraftConfig(kind="history", draft_len=2),
                    rollout=dataclasses.replace(CFG.rollout, engine=CFG.rollout.engine.replace(
                        adaptive=dict(enabled=False))),
                    checkpoint=CheckpointConfig(save_on_exit=True, resume=True))
  full = run_rl(cfg, base_model, TOK, out_dir=str(tmp_path / "full"), verbose=False)
  records = read_metrics(full["metrics_path"])
  assert [r["data/epoch"] for r in records] == [0, 1, 2, 3]
  assert [r["draft/history_prompts"] for r in records] == [8] * 4
  # the first visit drafts by n-gram lookup in the row alone; later visits from the history
  first, later = records[0], records[1:]
  assert all(r["spec/acceptance_length"] > first["spec/acceptance_length"] + 0.2 for r in later), \
      [r["spec/acceptance_length"] for r in records]

  with pytest.raises(KeyboardInterrupt):
    run_rl(cfg, base_model, TOK, out_dir=str(tmp_path / "split"), hooks=[interrupt_at(2)],
           verbose=False)
  resumed = run_rl(cfg, base_model, TOK, out_dir=str(tmp_path / "split"), verbose=False)
  assert resumed["start_step"] == 2
  assert _strip_times(records) == _strip_times(read_metrics(resumed["metrics_path"]))


class FlakyArithmetic(ArithmeticTask):
  """Its verifier crashes on every answer that starts with "1"."""

  def score(self, completion, example):
    if completion.startswith("1"):
      raise RuntimeError("verifier exploded")
    return super().score(completion, example)


def test_a_reward_function_that_raises_scores_zero_is_logged_and_the_loop_goes_on(
    base_model, tmp_path):
  with pytest.warns(UserWarning, match="reward function error"):
    summary = run_rl(CFG, base_model, TOK, FlakyArithmetic(CFG.task, TOK),
                     out_dir=str(tmp_path), stop_after=2, verbose=False)
  assert summary["steps"] == 2
  records = read_metrics(summary["metrics_path"])
  assert all(r["reward/errors"] > 0 for r in records)
  events = read_metrics(summary["metrics_path"], events=True)
  errors = [e for e in events if e["event"] == "reward_error"]
  assert errors and "verifier exploded" in errors[0]["message"]
  # the other events are the rollout engine's segments (bucket, K, measured tokens/s)
  assert all(e["event"] in ("reward_error", "engine_segment") for e in events)
  assert any(e["event"] == "engine_segment" and e["tokens_per_s"] > 0 for e in events)


def test_colocated_prepare_hands_the_sampler_the_very_same_arrays_unless_it_must_cast(base_model):
  from specjax.rl.loop import setup_run

  run, state = setup_run(CFG, base_model, TOK)
  fwd = run.trainer.forward_params(state.params)
  gen, _ = run.sampler.prepare(state.params, fwd)
  assert all(a is b for a, b in zip(jax.tree.leaves(gen), jax.tree.leaves(fwd)))
  run16, state16 = setup_run(CFG.replace(rollout=dataclasses.replace(CFG.rollout,
                                                                      gen_dtype="bfloat16")),
                             base_model, TOK)
  gen16, _ = run16.sampler.prepare(state16.params, run16.trainer.forward_params(state16.params))
  assert {x.dtype for x in jax.tree.leaves(gen16)} == {np.dtype("bfloat16")}


def test_invalid_config_values_fail_with_the_field_named(tmp_path):
  with pytest.raises(ValueError, match="GRPOConfig.clip_low"):
    GRPOConfig(clip_low=1.5)
  with pytest.raises(ValueError, match="GRPOConfig.adv_mode"):
    GRPOConfig(adv_mode="ppo")
  with pytest.raises(ValueError, match="OptimConfig.schedule"):
    OptimConfig(schedule="step")
  # a kind without an online loss has nothing to adapt: online reads as False, not an error,
  # so --rl.draft.kind ngram works on top of defaults that adapt an EAGLE-3 head online
  assert DraftConfig(kind="ngram", online=True).online is False
  assert DraftConfig(kind="eagle3", online=True).online is True
  with pytest.raises(ValueError, match="RLConfig.micro_batches"):
    RLConfig(prompts_per_step=3, grpo=GRPOConfig(group_size=2), micro_batches=4)
  with pytest.raises(ValueError, match="RLConfig.minibatches"):
    RLConfig(minibatches=0)
  assert RLConfig(steps=10, minibatches=4).optimizer_steps == 40
  with pytest.raises(ValueError, match="RolloutConfig.top_p"):
    RolloutConfig(top_p=0.0)
  with pytest.raises(ValueError, match="DraftConfig.tree_width"):
    DraftConfig(tree_width=0)
  with pytest.raises(ValueError, match="DraftConfig.tree_depth"):
    DraftConfig(tree_depth=-1)
  # a draft tree needs a drafter that ranks its candidates; dense or paged KV memory
  model_cfg = ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=1,
                          num_kv_heads=1, head_dim=8, mlp_hidden=16)
  graphdef = nnx.split(Decoder(model_cfg, rngs=nnx.Rngs(0)))[0]
  with pytest.raises(ValueError, match="DraftConfig.tree_width=2: the 'ngram' drafter"):
    build_drafter(RLConfig(draft=DraftConfig(kind="ngram", tree_width=2)), graphdef, model_cfg)
  drafter, _ = build_drafter(RLConfig(draft=DraftConfig(kind="mtp", tree_width=2),
                                      rollout=RolloutConfig(engine=RolloutConfig.engine.replace(
                                          paging=dict(kv_cache_gb=0.01)))), graphdef,
                             model_cfg.replace(mtp=True))
  assert drafter.tree_width == 2  # trees run on pages too
  drafter, _ = build_drafter(RLConfig(draft=DraftConfig(kind="mtp", tree_width=2, tree_depth=1,
                                                        tree_argmax=True)),
                             graphdef, model_cfg.replace(mtp=True))
  assert (drafter.tree_width, drafter.tree_depth, drafter.tree.nodes) == (2, 1, 1 + 3 + 1)
  assert drafter.tree_argmax
  bad = tmp_path / "bad.yaml"
  bad.write_text("grpo:\n  group_sise: 4\n")
  with pytest.raises(ValueError, match=r"RLConfig.grpo.group_sise: unknown field"):
    load_config(str(bad))


def test_config_loads_from_yaml_and_the_cli_overrides_it(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text("steps: 7\ngrpo:\n  group_size: 4\n  beta: 0.01\ndraft:\n  kind: eagle3\n"
                  "  online: true\nmodel:\n  hidden_size: 32\n  aux_layers: [0, 1, 1]\n")
  cfg = load_config(str(path), ["--grpo.group-size", "16", "--draft.draft-len", "5"])
  assert cfg.steps == 7 and cfg.grpo.beta == 0.01 and cfg.grpo.group_size == 16
  assert cfg.draft.kind == "eagle3" and cfg.draft.online and cfg.draft.draft_len == 5
  assert cfg.model.hidden_size == 32 and cfg.model.aux_layers == (0, 1, 1)
  assert dataclasses.replace(cfg) == cfg


def test_a_torn_final_metrics_line_is_skipped_by_the_reader_and_trimmed_by_the_writer(tmp_path):
  path = tmp_path / "metrics.jsonl"
  append_jsonl(str(path), {"step": 1, "reward/mean": 0.5})
  with open(path, "a") as f:
    f.write('{"step": 2, "reward/me')  # a crash in the middle of an append
  with pytest.warns(UserWarning, match="torn"):
    assert read_metrics(str(path)) == [{"step": 1, "reward/mean": 0.5}]
  with pytest.warns(UserWarning, match="trimmed"):
    logger = MetricsLogger(str(tmp_path), total_steps=3, tensorboard=False, progress=False)
  logger.log(2, {"reward/mean": np.float32(0.75)})
  logger.close()
  lines = path.read_text().splitlines()
  assert [json.loads(x)["step"] for x in lines] == [1, 2]
