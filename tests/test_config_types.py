"""Every config field is strictly typed from YAML and from the CLI: a wrong type is an error that
names the field (and the file), never a value silently taken."""

import pytest

from specjax.config_tree import parse_args
from specjax.errors import UserError
from specjax.jobs.config import ExperimentConfig
from specjax.rl.config import load_config


def _yaml(tmp_path, text):
  path = tmp_path / "cfg.yaml"
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("text, field, shown", [
    ("grpo:\n  group_size: 2.5\n", "RLConfig.grpo.group_size", "expected an int, got 2.5"),
    ("steps: three\n", "RLConfig.steps", "expected an int, got 'three'"),
    ("steps: true\n", "RLConfig.steps", "expected an int, got True"),
    ("draft:\n  online: \"no\"\n", "RLConfig.draft.online", "expected a bool"),
    ("draft:\n  online: 1\n", "RLConfig.draft.online", "expected a bool"),
    ("policy_optim:\n  lr: fast\n", "RLConfig.policy_optim.lr", "expected a float"),
    ("task:\n  path: 3\n", "RLConfig.task.path", "expected a string"),
    ("model:\n  aux_layers: [0, 1.5, 1]\n", "RLConfig.model.aux_layers[1]", "expected an int"),
])
def test_a_yaml_value_of_the_wrong_type_names_the_file_and_the_field(tmp_path, text, field,
                                                                      shown):
  path = _yaml(tmp_path, text)
  with pytest.raises(ValueError) as e:
    load_config(path)
  assert str(e.value).startswith(f"{path}: {field}: {shown}"), str(e.value)


def test_yaml_numbers_that_fit_are_taken():
  # ints for float fields and YAML 1.1's string form of 1e-3 are floats; true/false are bools
  import tempfile

  with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
    f.write("policy_optim:\n  lr: 1e-3\n  clip_norm: 2\n"
            "rollout:\n  engine:\n    adaptive:\n      enabled: false\n")
  cfg = load_config(f.name)
  assert cfg.policy_optim.lr == 1e-3 and isinstance(cfg.policy_optim.clip_norm, float)
  assert cfg.rollout.engine.adaptive.enabled is False
  # the rest of the engine keeps the RL run's defaults (programs compiled ahead)
  assert cfg.rollout.engine.compile.ahead is True


def test_a_range_error_in_yaml_names_the_file_too(tmp_path):
  path = _yaml(tmp_path, "grpo:\n  group_size: 0\n")
  with pytest.raises(ValueError, match=rf"^{path}: GRPOConfig.group_size: must be >= 1"):
    load_config(path)


def test_a_draft_length_ladder_with_k_0_is_refused_when_the_config_is_read(tmp_path):
  # (not minutes later, when the first rollout builds the engine's config)
  path = _yaml(tmp_path, "rollout:\n  engine:\n    adaptive:\n      draft_lens: [2, 0]\n")
  with pytest.raises(ValueError,
                     match=rf"^{path}: EngineConfig.adaptive.draft_lens: must be K >= 1"):
    load_config(path)


def test_the_experiment_launcher_names_its_yaml_file_and_the_nested_field(tmp_path):
  path = _yaml(tmp_path, "rl:\n  grpo:\n    group_size: 2.5\n")
  with pytest.raises(ValueError, match=rf"^{path}: ExperimentConfig.rl.grpo.group_size: "
                                       r"expected an int, got 2.5"):
    parse_args(ExperimentConfig(), ["--config", path])


@pytest.mark.parametrize("args, flag", [
    (["--rl.steps", "2.5"], "--rl.steps"),
    (["--rl.steps", "three"], "--rl.steps"),
    (["--rl.grpo.group-size", "2.5"], "--rl.grpo.group-size"),
    # bools are flags (--rl.draft.online / --rl.draft.no-online): a value after one is refused
    (["--rl.draft.online", "no"], "Unrecognized options"),
])
def test_a_cli_value_of_the_wrong_type_is_refused_naming_the_flag(args, flag, capsys):
  with pytest.raises(SystemExit) as e:
    parse_args(ExperimentConfig(), args)
  assert e.value.code != 0
  err = capsys.readouterr()
  assert flag in err.out + err.err


def test_a_yaml_key_at_a_moved_path_is_refused_naming_the_new_key(tmp_path):
  path = _yaml(tmp_path, "rollout:\n  train_packing: false\n")
  with pytest.raises(ValueError, match=rf"^{path}: RLConfig.rollout.train_packing: moved to "
                                       r"train.packing$"):
    load_config(path)
  path = _yaml(tmp_path, "rl:\n  rollout:\n    train_pack_rows: 2\n")
  with pytest.raises(ValueError, match=r"ExperimentConfig.rl.rollout.train_pack_rows: moved to "
                                       r"rl.train.pack_rows$"):
    parse_args(ExperimentConfig(), ["--config", path])


@pytest.mark.parametrize("args, shown", [
    (["--rl.rollout.train-packing"], "--rl.rollout.train-packing: moved to --rl.train.packing"),
    (["--rl.rollout.no-train-packing"],
     "--rl.rollout.no-train-packing: moved to --rl.train.no-packing"),
    (["--rl.rollout.train-width-block=8"],
     "--rl.rollout.train-width-block: moved to --rl.train.width-block"),
])
def test_a_cli_flag_at_a_moved_path_is_refused_naming_the_new_flag(args, shown):
  with pytest.raises(UserError, match=f"^{shown}$"):
    parse_args(ExperimentConfig(), args)
  cfg = parse_args(ExperimentConfig(), ["--rl.train.no-packing", "--rl.train.width-block", "8"])
  assert not cfg.rl.train.packing and cfg.rl.train.width_block == 8


@pytest.mark.parametrize("args, shown", [
    (["--rl.rollout.max-rows", "64"], "--rl.rollout.max-rows: moved to "
                                      "--rl.rollout.engine.queue.max-rows"),
    (["--rl.rollout.no-compaction"], "--rl.rollout.no-compaction: moved to "
                                     "--rl.rollout.engine.buckets.no-compaction"),
    (["--rl.rollout.compile-ahead"], "--rl.rollout.compile-ahead: moved to "
                                     "--rl.rollout.engine.compile.ahead"),
    (["--rl.draft.no-adaptive"], "--rl.draft.no-adaptive: moved to "
                                 "--rl.rollout.engine.adaptive.no-enabled"),
    (["--rl.draft.draft-lens", "2", "4"], "--rl.draft.draft-lens: moved to "
                                          "--rl.rollout.engine.adaptive.draft-lens"),
])
def test_the_engines_old_flags_name_their_place_in_the_engine_tree(args, shown):
  with pytest.raises(UserError, match=f"^{shown}$"):
    parse_args(ExperimentConfig(), args)


def test_every_engine_field_is_a_flag_and_a_yaml_key(tmp_path):
  """The engine's tree sits in the RL config whole: settings the RL config never mirrored (the
  paged kernel's launch, page_ahead, calibration) are reachable too."""
  cfg = parse_args(ExperimentConfig(), [
      "--rl.rollout.engine.paging.kernel-pages", "4", "--rl.rollout.engine.paging.page-ahead", "8",
      "--rl.rollout.engine.queue.max-rows", "64", "--rl.rollout.engine.adaptive.no-enabled",
      "--rl.rollout.engine.adaptive.draft-lens", "2", "4",
      "--rl.rollout.engine.calibration.repeats", "3"])
  engine = cfg.rl.rollout.engine
  assert (engine.paging.kernel_pages, engine.paging.page_ahead, engine.queue.max_rows) == (4, 8, 64)
  assert not engine.adaptive.enabled and engine.adaptive.draft_lens == (2, 4)
  assert engine.calibration.repeats == 3 and engine.compile.ahead  # (the RL default kept)
  path = _yaml(tmp_path, "rl:\n  rollout:\n    engine:\n      paging:\n        kernel_warps: 2\n")
  engine = parse_args(ExperimentConfig(), ["--config", path]).rl.rollout.engine
  assert engine.paging.kernel_warps == 2
  path = _yaml(tmp_path, "rl:\n  draft:\n    max_draft_len: 5\n")
  with pytest.raises(ValueError, match=r"ExperimentConfig.rl.draft.max_draft_len: moved to "
                                       r"rl.rollout.engine.adaptive.max_draft_len$"):
    parse_args(ExperimentConfig(), ["--config", path])
