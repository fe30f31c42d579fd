"""A user's mistake on a job's command line (a dataset, a checkpoint, a value, a path, a config
file, a memory budget) ends in one line on stderr that names the culprit and exit code 2, within
seconds (before anything is compiled) and without a traceback; nothing is written into an
existing run directory. --debug or SPECJAX_DEBUG=1 shows the traceback.

Most mistakes run the job's `main` in this process, as its command line does (`run_main`: the
exit code is its `SystemExit`'s, stderr what it wrote): a new process would spend its seconds
importing jax. A few run the script itself in a new process, for what only a process shows."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = os.path.join(ROOT, "tests", "fixtures", "qwen3_tiny")
GSM8K = os.path.join(ROOT, "tests", "fixtures", "gsm8k_tiny.jsonl")
# the tiny run that completes in about a minute when nothing is wrong
TINY = ["--rl.draft.kind", "ngram", "--rl.draft.no-online", "--rl.prompts-per-step", "2",
        "--rl.grpo.group-size", "2", "--rl.rollout.max-new-tokens", "8",
        "--rl.validation.every", "0", "--no-compare", "--rl.no-progress", "--rl.steps", "3"]
ROW = {"question": "what is 1 plus 1 ?", "answer": "1 plus 1 is 2 . #### 2"}


def _job_env(tmp_path) -> dict[str, str]:
  """A job's files of its own under tmp_path: the engine's cost cache, datasets' cache."""
  return {"SPECJAX_COST_CACHE": str(tmp_path / "costs.json"),
          "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}


def _run(script: str, args: list[str], tmp_path, env: dict | None = None):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **_job_env(tmp_path), **(env or {}))
  if "SPECJAX_DEBUG" not in (env or {}):
    env.pop("SPECJAX_DEBUG", None)
  return subprocess.run([sys.executable, os.path.join("experiments", script), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def in_process(tmp_path, monkeypatch, capsys):
  """Runs `rl_zero.py`'s main in this process as its command line does: (exit code, stderr)."""
  from experiments import rl_zero
  from specjax.jobs.console import run_main

  for name, value in _job_env(tmp_path).items():
    monkeypatch.setenv(name, value)
  monkeypatch.delenv("SPECJAX_DEBUG", raising=False)

  def run(args):
    capsys.readouterr()
    try:
      run_main(rl_zero.main, args)
      code = 0
    except SystemExit as e:
      code = e.code
    return types.SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)
  return run


def _rl_zero(tmp_path, *, model=QWEN3, dataset=GSM8K, out=None, extra=(), run=None):
  """The job on a mistake's arguments: through `run` (the `in_process` fixture), or without it
  as a new process."""
  args = ["--model-path", str(model), "--dataset", str(dataset), *TINY,
          "--out-dir", str(out or tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache"),
          *extra]
  return _run("rl_zero.py", args, tmp_path) if run is None else run(args)


def _assert_user_error(proc, culprit: str) -> str:
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert 1 <= len(lines) <= 3, proc.stderr
  assert lines[-1].startswith("specjax: error: "), proc.stderr
  assert culprit in lines[-1], (culprit, lines[-1])
  return lines[-1]


def _jsonl(path, lines: list[str]) -> str:
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


def _model_copy(tmp_path, edit) -> str:
  path = tmp_path / "model"
  shutil.copytree(QWEN3, path)
  edit(path)
  return str(path)


def _truncate(file):
  data = file.read_bytes()
  file.write_bytes(data[:len(data) // 2])


def _config(path, **changes):
  cfg = json.loads((path / "config.json").read_text())
  cfg.update(changes)
  (path / "config.json").write_text(json.dumps(cfg))


# mistake -> (rl_zero.py arguments, the text that names the culprit), built in tmp_path
def _broken_json_line(tmp):
  path = _jsonl(tmp / "d.jsonl", [json.dumps(ROW), json.dumps(ROW), '{"question": "x", '])
  return dict(dataset=path), f"{path}:3: invalid JSON"


def _empty_dataset(tmp):
  path = _jsonl(tmp / "d.jsonl", [])
  return dict(dataset=path), f"{path}: the dataset has no rows"


def _missing_field(tmp):
  path = _jsonl(tmp / "d.jsonl", [json.dumps({"question": "what is 1 plus 1 ?"})])
  return dict(dataset=path), f"{path}:1: missing field 'answer'"


def _wrong_type(tmp):
  path = _jsonl(tmp / "d.jsonl", [json.dumps(ROW), json.dumps(dict(ROW, question=["x"]))])
  return dict(dataset=path), f"{path}:2: field 'question' must be a string"


def _row_not_an_object(tmp):
  path = _jsonl(tmp / "d.jsonl", [json.dumps(ROW), "[1, 2]"])
  return dict(dataset=path), f"{path}:2: expected a JSON object"


def _missing_dataset(tmp):
  return dict(dataset=tmp / "nope.jsonl"), f"{tmp / 'nope.jsonl'} does not exist"


def _damaged_parquet(tmp):
  (tmp / "d.parquet").write_bytes(b"PAR1 not really")
  return dict(dataset=tmp / "d.parquet"), f"{tmp / 'd.parquet'}: not a readable parquet file"


def _missing_checkpoint(tmp):
  return dict(model=tmp / "nope"), f"--model-path {tmp / 'nope'}: does not exist"


def _checkpoint_without_config(tmp):
  path = _model_copy(tmp, lambda p: (p / "config.json").unlink())
  return dict(model=path), f"--model-path {path}: no config.json"


def _damaged_config(tmp):
  path = _model_copy(tmp, lambda p: (p / "config.json").write_text('{"vocab_size": '))
  return dict(model=path), f"{path}/config.json: not valid JSON"


def _damaged_safetensors(tmp):
  path = _model_copy(tmp, lambda p: _truncate(p / "model.safetensors"))
  return dict(model=path), f"{path}/model.safetensors: damaged safetensors file"


def _unsupported_architecture(tmp):
  path = _model_copy(tmp, lambda p: _config(p, architectures=["MixtralForCausalLM"],
                                            model_type="mixtral"))
  return dict(model=path), f"{path}/config.json: unsupported architecture ['MixtralForCausalLM']"


def _damaged_tokenizer(tmp):
  path = _model_copy(tmp, lambda p: (p / "tokenizer.json").write_text("{}"))
  return dict(model=path), f"{path}/tokenizer.json: not a readable tokenizer"


def _bad_value(tmp):
  return dict(extra=["--rl.grpo.group-size", "0"]), "GRPOConfig.group_size: must be >= 1, got 0"


def _moved_flag(tmp):
  return (dict(extra=["--rl.rollout.no-train-packing"]),
          "--rl.rollout.no-train-packing: moved to --rl.train.no-packing")


def _mesh_does_not_fit(tmp):
  return (dict(extra=["--rl.use-mesh", "--rl.mesh.tensor", "3"]),
          "RLConfig.mesh: mesh (data=1, fsdp=-1, tensor=3) does not fit")


def _impossible_kv_budget(tmp):
  return (dict(extra=["--rl.rollout.engine.paging.kv-cache-gb", "0.000001"]),
          "RolloutConfig.engine.paging.kv_cache_gb: 1e-06 GiB holds 0 pages")


def _out_dir_is_a_file(tmp):
  (tmp / "a-file").write_text("")
  return dict(out=tmp / "a-file"), f"ExperimentConfig.out_dir: {tmp / 'a-file'} is a file"


def _run_dir_taken(tmp):
  (tmp / "runs" / "rl_zero").mkdir(parents=True)
  (tmp / "runs" / "rl_zero" / "summary.json").write_text("{}")
  return dict(), f"{tmp / 'runs' / 'rl_zero'} holds an earlier run"


def _typed_yaml_error(tmp):
  (tmp / "c.yaml").write_text("rl:\n  rollout:\n    max_new_tokens: many\n")
  return (dict(extra=["--config", str(tmp / "c.yaml")]),
          f"{tmp / 'c.yaml'}: ExperimentConfig.rl.rollout.max_new_tokens: expected an int")


def _malformed_yaml(tmp):
  (tmp / "c.yaml").write_text("rl:\n  steps: [1, 2\n")
  return dict(extra=["--config", str(tmp / "c.yaml")]), f"{tmp / 'c.yaml'}:3: not valid YAML"


def _missing_config_file(tmp):
  return (dict(extra=["--config", str(tmp / "nope.yaml")]),
          f"--config: {tmp / 'nope.yaml'} does not exist")


def _missing_draft_path(tmp):
  return (dict(extra=["--rl.draft.kind", "eagle3", "--rl.draft.path", str(tmp / "nope")]),
          f"DraftConfig.path: {tmp / 'nope'} does not exist")


def _draft_path_not_a_head(tmp):
  (tmp / "head").mkdir()
  return (dict(extra=["--rl.draft.kind", "eagle3", "--rl.draft.path", str(tmp / "head")]),
          f"draft head: {tmp / 'head'} is neither a head of specjax's save_head nor a community "
          "EAGLE-3 directory")


def _export_dir_not_empty(tmp):
  (tmp / "export").mkdir()
  (tmp / "export" / "x").write_text("")
  return (dict(extra=["--export-hf", str(tmp / "export")]),
          f"ExperimentConfig.export_hf: {tmp / 'export'} exists and is not empty")


MISTAKES = [_broken_json_line, _empty_dataset, _missing_field, _wrong_type, _row_not_an_object,
            _missing_dataset, _damaged_parquet, _missing_checkpoint, _checkpoint_without_config,
            _damaged_config, _damaged_safetensors, _unsupported_architecture, _damaged_tokenizer,
            _bad_value, _moved_flag, _mesh_does_not_fit, _impossible_kv_budget,
            _out_dir_is_a_file, _run_dir_taken, _typed_yaml_error, _malformed_yaml,
            _missing_config_file, _missing_draft_path, _draft_path_not_a_head,
            _export_dir_not_empty]


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.__name__.strip("_"))
def test_a_mistake_is_one_line_naming_the_culprit_and_exit_code_2(tmp_path, mistake, in_process):
  kw, culprit = mistake(tmp_path)
  _assert_user_error(_rl_zero(tmp_path, **kw, run=in_process), culprit)


@pytest.mark.parametrize("mistake", [_bad_value, _broken_json_line],
                         ids=lambda m: m.__name__.strip("_"))
def test_the_script_in_a_new_process_ends_a_mistake_in_one_line_and_exit_code_2(tmp_path,
                                                                                mistake):
  kw, culprit = mistake(tmp_path)
  _assert_user_error(_rl_zero(tmp_path, **kw), culprit)


@pytest.mark.parametrize("how", [["--debug"], "SPECJAX_DEBUG"])
def test_debug_shows_the_traceback_of_a_mistake(tmp_path, how):
  args = ["--rl.grpo.group-size", "0", "--out-dir", str(tmp_path / "runs")]
  if how == "SPECJAX_DEBUG":
    proc = _run("rl_zero.py", args, tmp_path, env={"SPECJAX_DEBUG": "1"})
  else:
    proc = _run("rl_zero.py", args + how, tmp_path)
  assert proc.returncode != 0
  assert "Traceback" in proc.stderr and "grpo.py" in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1].endswith("GRPOConfig.group_size: must be >= 1, "
                                                       "got 0")


def _tree(path) -> dict[str, str]:
  """Every file and directory under `path`: relative path -> sha256 (directories: "dir")."""
  out = {}
  for root, dirs, files in os.walk(path):
    for d in dirs:
      out[os.path.relpath(os.path.join(root, d), path)] = "dir"
    for f in files:
      with open(os.path.join(root, f), "rb") as fh:
        out[os.path.relpath(os.path.join(root, f), path)] = hashlib.sha256(fh.read()).hexdigest()
  return out


@pytest.mark.parametrize("flag, mistake", [("--resume", _broken_json_line),
                                           ("--resume", _impossible_kv_budget),
                                           ("--fresh", _damaged_safetensors)],
                         ids=["resume-dataset", "resume-kv-budget", "fresh-checkpoint"])
def test_a_mistake_on_resume_or_fresh_leaves_the_run_directory_byte_identical(tmp_path, flag,
                                                                             mistake, in_process):
  run = tmp_path / "runs" / "rl_zero"
  for name, text in {"summary.json": '{"runs": {}}\n', "spec/metrics.jsonl": '{"step": 1}\n',
                     "spec/checkpoints/1/state": "state", "spec/engine_tuning.json": "{}",
                     "spec/engine_costs.json": "{}"}.items():
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    (run / name).write_text(text)
  before = _tree(tmp_path / "runs")
  kw, culprit = mistake(tmp_path)
  kw["extra"] = [*kw.get("extra", ()), flag]
  _assert_user_error(_rl_zero(tmp_path, **kw, run=in_process), culprit)
  assert _tree(tmp_path / "runs") == before


def test_rl_zero_seeds_reports_a_bad_value_of_its_experiment_in_one_line(tmp_path):
  proc = _run("rl_zero_seeds.py", ["--seeds", "0", "--out-dir", str(tmp_path / "runs"),
                                   "--rl.rollout.temperature", "-1"], tmp_path)
  _assert_user_error(proc, "RolloutConfig.temperature: must be >= 0, got -1.0")
  assert not (tmp_path / "runs").exists()


def test_the_simulator_reports_a_bad_value_in_one_line(tmp_path):
  proc = _run("simulate.py", ["--draft-len", "-1"], tmp_path)
  _assert_user_error(proc, "Scenario.draft_len: must be in [0, 16], got -1")
  proc = _run("simulate.py", ["--model", "gpt-9"], tmp_path)
  _assert_user_error(proc, "unknown model 'gpt-9'")
