"""The experiment never deletes a run implicitly, gives each run its own checkpoints, and names the
file, field or value of every bad input before it touches an earlier run."""

import os
import sys

import pytest
from flax import nnx

from specjax.errors import UserError
from specjax.jobs.config import ExperimentConfig
from specjax.jobs.run_dir import (Replacement, check_flags, check_kv_budget, check_model_dir,
                                  check_policy, claim_run_dir, run_paths)
from specjax.models import CharTokenizer, Decoder, ModelConfig, save_pretrained
from specjax.rl.async_rl.config import AsyncConfig
from specjax.rl.config import CheckpointConfig, RLConfig
from specjax.rl.grpo import GRPOConfig
from specjax.sharding import MeshConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))

TOK = CharTokenizer()
MODEL = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=16, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, mlp_hidden=32)
TINY = ["--base.steps", "2", "--base.examples", "32", "--base.batch-size", "8",
        "--draft-init.steps", "2", "--draft-init.prompts", "8", "--draft-init.batch-size", "4",
        "--rl.steps", "1", "--rl.prompts-per-step", "2", "--rl.grpo.group-size", "2",
        "--rl.rollout.max-new-tokens", "2", "--rl.no-progress", "--rl.no-tensorboard",
        "--rl.model.hidden-size", "16", "--rl.model.num-layers", "4", "--rl.model.mlp-hidden", "32",
        "--rl.model.num-heads", "2", "--rl.model.num-kv-heads", "1", "--rl.model.head-dim", "8",
        "--rl.model.aux-layers", "1", "2", "3", "--base.pretrain-layers", "0",
        "--base.pretrain-mlp-hidden", "0",
        "--rl.validation.every", "0",
        # the plain loop: one program per arm (the engine's buckets and K are not under test here)
        "--rl.rollout.engine.adaptive.no-enabled", "--rl.rollout.engine.buckets.no-compaction"]


def test_an_existing_run_is_refused_without_resume_or_fresh(tmp_path):
  out = tmp_path / "exp"
  out.mkdir()
  claim_run_dir(str(out), resume=False, fresh=False)  # an empty directory is no run
  (out / "summary.json").write_text("{}")
  with pytest.raises(UserError, match=r"holds an earlier run.*--resume.*--fresh"):
    claim_run_dir(str(out), resume=False, fresh=False)
  claim_run_dir(str(out), resume=True, fresh=False)
  claim_run_dir(str(out), resume=False, fresh=True)


def test_an_out_dir_that_is_or_lies_under_a_file_is_refused_naming_the_file(tmp_path):
  (tmp_path / "a-file").write_text("")
  for out in (tmp_path / "a-file", tmp_path / "a-file" / "exp"):
    with pytest.raises(UserError, match=rf"ExperimentConfig.out_dir: {tmp_path / 'a-file'} is a "
                                        r"file, not a directory"):
      claim_run_dir(str(out), resume=True, fresh=False)
  claim_run_dir(str(tmp_path / "new" / "exp"), resume=False, fresh=False)  # made later
  assert not (tmp_path / "new").exists()


def test_a_kv_budget_no_row_fits_in_is_refused_from_the_config_as_the_engine_would():
  from specjax.rl.config import RolloutConfig
  from specjax.sampling.engine.paged_state import bytes_per_page, pool_size

  def cfg(gb, max_prompt_len=0):
    return ExperimentConfig(rl=RLConfig(rollout=RolloutConfig(
        max_new_tokens=40, max_prompt_len=max_prompt_len,
        engine=RolloutConfig.engine.replace(paging=dict(kv_cache_gb=gb, page_size=16)))))

  page = bytes_per_page(MODEL.num_layers, MODEL.num_kv_heads, MODEL.head_dim, 16, "float32")
  with pytest.raises(UserError, match=r"RolloutConfig.engine.paging.kv_cache_gb: .* holds 2 "
                                      r"pages of 16 tokens"
                                      r".* one row needs 3 pages \(41 positions: a prompt of >= 1 "
                                      r"\+ max_new_tokens 40\); raise it"):
    check_kv_budget(cfg(2.5 * page / 2**30), MODEL, task=None)
  with pytest.raises(UserError):  # the engine refuses the same pool for the shortest prompt
    pool_size(2.5 * page / 2**30, page, 16, 1 + 40)
  check_kv_budget(cfg(3.5 * page / 2**30), MODEL, task=None)
  with pytest.raises(UserError, match=r"one row needs 4 pages \(60 positions: a prompt of >= 20 "):
    check_kv_budget(cfg(3.5 * page / 2**30, max_prompt_len=20), MODEL, task=None)
  check_kv_budget(cfg(0.0), MODEL, task=None)  # dense caches


def test_bad_flag_combinations_are_named_before_anything_runs():
  with pytest.raises(ValueError, match="ExperimentConfig.fresh: --fresh .* --resume"):
    check_flags(ExperimentConfig(fresh=True, resume=True))
  with pytest.raises(ValueError, match="ExperimentConfig.dataset: --dataset gsm8k.jsonl needs "
                                       "--model-path"):
    check_flags(ExperimentConfig(dataset="gsm8k.jsonl"))
  with pytest.raises(ValueError, match="RLConfig.steps: an experiment needs >= 1 step, got 0"):
    check_flags(ExperimentConfig(rl=RLConfig(steps=0)))


def test_fresh_moves_the_old_run_aside_and_deletes_it_only_at_commit(tmp_path):
  out = tmp_path / "exp"
  (out / "ar").mkdir(parents=True)
  (out / "summary.json").write_text("old")
  logs = []
  replaced = Replacement([str(out), ""], logs.append)
  assert not out.exists()
  (aside,) = [p for p in os.listdir(tmp_path) if p.startswith("exp.replaced-")]
  assert (tmp_path / aside / "summary.json").read_text() == "old"
  replaced.commit()
  assert not (tmp_path / aside).exists() and len(logs) == 2


def test_each_run_gets_its_own_checkpoint_and_log_dirs():
  shared = RLConfig(checkpoint=CheckpointConfig(dir="/ckpt"), log_dir="/logs")
  ar, spec = run_paths("/out/x", "ar", shared), run_paths("/out/x", "spec", shared)
  assert (ar.checkpoint_dir, spec.checkpoint_dir) == ("/ckpt/ar", "/ckpt/spec")
  assert (ar.log_dir, spec.log_dir) == ("/logs/ar", "/logs/spec")
  default = run_paths("/out/x", "spec", RLConfig())
  assert (default.run_dir, default.checkpoint_dir, default.log_dir) == ("/out/x/spec", "", "")


def test_a_damaged_config_or_safetensors_file_is_named(tmp_path):
  path = tmp_path / "model"
  save_pretrained(Decoder(MODEL, rngs=nnx.Rngs(0)), str(path))
  check_model_dir(str(path))
  (weights,) = [p for p in os.listdir(path) if p.endswith(".safetensors")]
  data = (path / weights).read_bytes()
  (path / weights).write_bytes(data[:len(data) // 2])  # truncated by a crashed copy
  with pytest.raises(ValueError, match=f"{path / weights}: damaged safetensors file"):
    check_model_dir(str(path))
  (path / weights).write_bytes(data)
  (path / "config.json").write_text('{"hidden_size": 16,')
  with pytest.raises(ValueError, match=f"{path / 'config.json'}: not valid JSON"):
    check_model_dir(str(path))


def test_a_model_vocabulary_smaller_than_its_tokenizer_is_refused():
  small = MODEL.replace(vocab_size=TOK.vocab_size - 1)
  with pytest.raises(ValueError, match=rf"ModelConfig.vocab_size: the model /m has "
                                       rf"{TOK.vocab_size - 1} embedding rows but its tokenizer "
                                       rf"{TOK.vocab_size} ids"):
    check_policy(ExperimentConfig(), small, TOK, "/m")


def test_mesh_sizes_that_do_not_fit_the_model_or_the_batch_are_refused():
  rl = RLConfig(use_mesh=True, prompts_per_step=3, grpo=GRPOConfig(group_size=4))  # batch 12
  cfg = ExperimentConfig(rl=rl.replace(mesh=MeshConfig(data=1, fsdp=2, tensor=4)))
  with pytest.raises(ValueError, match="RLConfig.mesh.tensor: tensor-parallel size 4 is larger "
                                       "than the model's 2 attention heads"):
    check_policy(cfg, MODEL, TOK, "m")
  cfg = ExperimentConfig(rl=rl.replace(mesh=MeshConfig(data=8, fsdp=1, tensor=1)))
  with pytest.raises(ValueError, match=r"RLConfig.mesh.data: the data-parallel shards \(data 8 x "
                                       r"fsdp 1 = 8\) must divide the rollout batch "
                                       r"prompts_per_step x group_size = 12"):
    check_policy(cfg, MODEL, TOK, "m")
  check_policy(ExperimentConfig(rl=rl.replace(mesh=MeshConfig(data=2, fsdp=2, tensor=2))), MODEL,
               TOK, "m")
  async_cfg = AsyncConfig(enabled=True, gen_mesh=MeshConfig(data=1, fsdp=1, tensor=4))
  with pytest.raises(ValueError, match="AsyncConfig.gen_mesh.tensor"):
    check_policy(ExperimentConfig(rl=rl, async_rl=async_cfg), MODEL, TOK, "m")


@pytest.mark.slow
def test_rl_zero_gives_each_run_its_checkpoints_refuses_a_rerun_and_fresh_waits_for_checks(
    tmp_path):
  import rl_zero

  base = ["--out-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache"),
          "--rl.checkpoint.dir", str(tmp_path / "ckpt")] + TINY
  rl_zero.main(base)
  out = tmp_path / "runs" / "rl_zero"
  # one shared --rl.checkpoint.dir: each run writes (and resumes from) its own subdirectory
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["ar", "spec"]
  assert os.listdir(tmp_path / "ckpt" / "ar") == ["1"] == os.listdir(tmp_path / "ckpt" / "spec")
  with pytest.raises(UserError, match="--resume .* --fresh"):
    rl_zero.main(base)
  # --fresh with a mesh that does not fit: refused before the earlier run is touched
  with pytest.raises(ValueError, match="RLConfig.mesh.tensor"):
    rl_zero.main(base + ["--fresh", "--rl.use-mesh", "--rl.mesh.tensor", "4",
                         "--rl.mesh.fsdp", "2"])
  assert (out / "summary.json").exists() and (out / "spec" / "metrics.jsonl").exists()
  assert os.listdir(tmp_path / "ckpt" / "spec") == ["1"]
