"""experiments/rl_zero.py from the command line with every draft kind: on the committed Qwen3
fixture with a GSM8K file (a published EAGLE-3 head, a truncated draft model, an MTP module
trained offline, n-gram, none), exporting the final policy with --export-hf, and on the embedded
default. Settings are tiny: what is pinned is that each path runs and what it writes reloads."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import specjax.models.export as export_module
from experiments import rl_zero
from specjax.drafters.checkpoint import load_draft_head
from specjax.drafters.mtp import checkpoint_has_mtp
from specjax.errors import UserError
from specjax.models.hf import load_pretrained, load_tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN3 = os.path.join(FIXTURES, "qwen3_tiny")
HEAD = os.path.join(FIXTURES, "qwen3_tiny_eagle3")
GSM8K = os.path.join(FIXTURES, "gsm8k_tiny.jsonl")

# one short program per run: fixed K, no live-batch buckets, no validation, no AR baseline
TINY = ["--rl.steps", "2", "--rl.prompts-per-step", "2", "--rl.grpo.group-size", "2",
        "--rl.rollout.max-new-tokens", "3", "--rl.validation.every", "0", "--rl.draft.draft-len",
        "2", "--rl.rollout.engine.adaptive.no-enabled",
        "--rl.rollout.engine.buckets.no-compaction", "--rl.no-progress",
        "--no-compare", "--draft-init.steps", "2", "--draft-init.prompts", "4",
        "--draft-init.batch-size", "2"]

KINDS = {
    "eagle3": ["--rl.draft.path", HEAD, "--rl.draft.online", "--rl.draft.ttt-steps", "1"],
    "eagle3-history": ["--rl.draft.path", HEAD, "--rl.draft.online", "--rl.draft.ttt-steps", "1"],
    "history": ["--rl.draft.no-online"],
    "draft-model": ["--rl.draft.no-online"],
    "mtp": ["--rl.draft.online"],
    "ngram": ["--rl.draft.no-online"],
    "group-ngram": ["--rl.draft.no-online"],
    "none": ["--rl.draft.no-online"],
}


@pytest.fixture
def exported(monkeypatch):
  """The models handed to export_hf, by output directory (the run's final policy)."""
  seen = {}
  real = export_module.export_hf

  def spy(model, out_dir, *args, **kw):
    seen[os.path.abspath(out_dir)] = model
    return real(model, out_dir, *args, **kw)

  monkeypatch.setattr(export_module, "export_hf", spy)
  return seen


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_rl_zero_runs_each_draft_kind_on_a_hf_checkpoint_and_exports_the_final_policy(
    kind, tmp_path, exported, capsys):
  out = tmp_path / "export"
  summary = rl_zero.main(["--model-path", QWEN3, "--dataset", GSM8K, "--rl.draft.kind", kind,
                          "--out-dir", str(tmp_path / "runs"), "--cache-dir",
                          str(tmp_path / "cache"), "--export-hf", str(out), *TINY, *KINDS[kind]])
  label = "spec" if kind != "none" else "ar"
  assert summary["runs"][label]["steps"] == 2
  final = exported[str(out)]
  ids = jnp.asarray(np.load(os.path.join(QWEN3, "input_ids.npy")))
  reloaded = load_pretrained(str(out), mtp=final.mtp is not None)
  np.testing.assert_array_equal(np.asarray(reloaded(ids).logits), np.asarray(final(ids).logits))
  assert load_tokenizer(str(out)).chat_template == load_tokenizer(QWEN3).chat_template
  log = capsys.readouterr().out
  if kind == "mtp":
    assert "ships no MTP weights: the MTP module is initialised and trained offline" in log
    assert checkpoint_has_mtp(str(out), reloaded.cfg)
    np.testing.assert_array_equal(np.asarray(reloaded.mtp.proj[...]),
                                  np.asarray(final.mtp.proj[...]))
  if kind in ("eagle3", "eagle3-history"):  # the RL-adapted head, in the community format,
    # beside the policy under the method's name
    head, maps = load_draft_head(str(out / kind), reloaded.cfg)
    assert maps.draft_vocab == 48
    assert os.path.isfile(tmp_path / "runs" / "rl_zero" / "spec" / "draft_hf" / "config.json")
  else:
    assert not os.path.exists(out / "eagle3")


@pytest.fixture(scope="module")
def embedded_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("embedded_cache"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft-model", "mtp"])
def test_rl_zero_runs_draft_model_and_mtp_on_the_embedded_default(kind, tmp_path, embedded_cache):
  # (online MTP adaptation is covered on the checkpoint above; here the offline-trained module)
  rl_zero.main(["--rl.draft.kind", kind, "--out-dir", str(tmp_path), "--cache-dir",
                embedded_cache, "--base.steps", "1", "--base.examples", "16",
                "--base.batch-size", "4", "--rl.model.hidden-size", "32", "--rl.model.num-heads",
                "2", "--rl.model.head-dim", "16", "--rl.model.mlp-hidden", "64",
                "--rl.task.operands", "3", "--base.pretrain-layers", "0",
                "--base.pretrain-mlp-hidden", "0", *TINY, "--rl.steps", "1",
                "--rl.draft.no-online"])
  assert os.path.isfile(tmp_path / "rl_zero" / "summary.json")


def test_a_dataset_is_visited_whole_not_through_the_embedded_tasks_prompt_pool():
  """The main job's revisited-pool option keeps a pool of the embedded task's prompts; --dataset
  takes the whole dataset, epoch after epoch, while a pool stays one flag away on the task."""
  from specjax.jobs.config import parse_config
  from specjax.jobs.driver import build_task, resolve_dataset

  pooled_default = parse_config(rl_zero.DEFAULTS, ["--rl.task.pool-size", "16"])
  assert pooled_default.rl.task.pool_size == 16
  cfg = resolve_dataset(parse_config(pooled_default, ["--dataset", GSM8K]))
  assert (cfg.rl.task.name, cfg.rl.task.path, cfg.rl.task.pool_size) == ("math", GSM8K, 0)
  tokenizer = load_tokenizer(QWEN3)
  task = build_task(cfg, tokenizer)
  prompts = [e.prompt for e in task.train_examples(0, 4)]
  assert len(set(prompts)) == 4, prompts  # the file's rows in turn, not a pool's
  pooled = parse_config(rl_zero.DEFAULTS, ["--rl.task.name", "math", "--rl.task.path", GSM8K,
                                           "--rl.task.pool-size", "2"])
  pool = build_task(pooled, tokenizer)
  assert len({e.prompt for e in pool.train_examples(0, 4)}) == 2


def test_bad_paths_are_errors_that_name_the_field(tmp_path):
  with pytest.raises(UserError, match="DraftConfig.path"):
    rl_zero.main(["--model-path", QWEN3, "--dataset", GSM8K, "--rl.draft.kind", "eagle3",
                  "--rl.draft.path", str(tmp_path / "missing"), "--out-dir", str(tmp_path / "a"),
                  *TINY])
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("")
  with pytest.raises(ValueError, match="ExperimentConfig.export_hf"):
    rl_zero.main(["--model-path", QWEN3, "--dataset", GSM8K, "--export-hf",
                  str(tmp_path / "full"), "--out-dir", str(tmp_path / "b"), *TINY])
