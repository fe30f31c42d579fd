"""The experiment's run directory and the checks a new run passes before it may replace an old one:
no directory is deleted implicitly, and each run (ar, spec) has its own checkpoint and log dirs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from typing import Any, Callable

from specjax.config_tree import check
from specjax.errors import UserError

logger = logging.getLogger(__name__)


def check_flags(cfg: Any) -> None:
  """Input errors caught before anything is built or touched (`cfg` an ExperimentConfig)."""
  check(not (cfg.fresh and cfg.resume), "ExperimentConfig.fresh",
        "--fresh (replace the run) and --resume (continue it) exclude each other")
  check(not cfg.dataset or bool(cfg.model_path), "ExperimentConfig.dataset",
        f"--dataset {cfg.dataset} needs --model-path: the embedded character tokenizer only "
        f"covers the arithmetic tasks' characters")
  check(cfg.rl.steps >= 1, "RLConfig.steps", f"an experiment needs >= 1 step, got {cfg.rl.steps}")
  check_dir_path(cfg.cache_dir, "ExperimentConfig.cache_dir")
  check_dir_path(cfg.rl.checkpoint.dir, "RLConfig.checkpoint.dir")
  check_dir_path(cfg.rl.log_dir, "RLConfig.log_dir")
  check(not cfg.rl.draft.path or os.path.exists(cfg.rl.draft.path), "DraftConfig.path",
        f"{cfg.rl.draft.path} does not exist")


def _holds_a_run(path: str) -> bool:
  return os.path.isdir(path) and bool(os.listdir(path))


def check_dir_path(path: str, where: str) -> None:
  """`path` can be a directory of ours: it is one, or the first part of it that exists is a
  directory we may write in (not a file, which would fail the first write deep in a run)."""
  if not path:
    return
  at = os.path.abspath(path)
  while not os.path.exists(at) and os.path.dirname(at) != at:
    at = os.path.dirname(at)
  if not os.path.isdir(at):
    raise UserError(f"{where}: {at} is a file, not a directory; choose another path")
  if not os.access(at, os.W_OK | os.X_OK):
    raise UserError(f"{where}: {at} is not writable; choose another path")


def claim_run_dir(out: str, *, resume: bool, fresh: bool) -> None:
  """Refuse an existing run directory unless the user said what to do with it, and a path that
  cannot be a directory; reads only (nothing is written before every check has passed)."""
  check_dir_path(out, "ExperimentConfig.out_dir")
  if _holds_a_run(out) and not (resume or fresh):
    raise UserError(
        f"{out} holds an earlier run ({', '.join(sorted(os.listdir(out))[:6])}); pass --resume to "
        f"continue it or --fresh to replace it (the old one is kept until the new run's "
        f"configuration, mesh, model and data have been checked)")


@dataclasses.dataclass
class RunPaths:
  """Where one run (label "ar" or "spec") writes: its directory, checkpoints and metrics."""

  run_dir: str
  checkpoint_dir: str  # "" -> <run_dir>/checkpoints
  log_dir: str  # "" -> <run_dir>


def run_paths(out: str, label: str, rl_cfg: Any) -> RunPaths:
  """Per-run paths: a --rl.checkpoint.dir / --rl.log-dir given once is split by run label, so
  the AR and speculative runs never share (or restore) each other's state or metrics."""
  sub = lambda d: os.path.join(d, label) if d else ""
  return RunPaths(os.path.join(out, label), sub(rl_cfg.checkpoint.dir), sub(rl_cfg.log_dir))


class Replacement:
  """--fresh: the old run's directories are renamed aside (atomically) right before the new run
  starts writing, and deleted only once it has finished; on a failure they stay, named in the
  error log, so nothing is lost."""

  def __init__(self, paths: list[str], log: Callable[[str], None] = logger.info):
    self.log = log
    self.moved: list[tuple[str, str]] = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in dict.fromkeys(os.path.abspath(p) for p in paths if p):
      if os.path.exists(path):
        aside = f"{path}.replaced-{stamp}-{os.getpid()}"
        os.rename(path, aside)
        self.moved.append((path, aside))
        log(f"[fresh] moved the earlier {path} aside to {aside}; deleted once this run finishes")

  def commit(self) -> None:
    for path, aside in self.moved:
      shutil.rmtree(aside, ignore_errors=True)
      self.log(f"[fresh] deleted the replaced run {aside}")
    self.moved = []

  def keep(self) -> None:
    for path, aside in self.moved:
      self.log(f"[fresh] the new run failed; the earlier run is kept at {aside}")


def check_model_dir(path: str) -> None:
  """A Hugging Face directory whose config.json and safetensors files are readable; errors name
  the file (a damaged file would otherwise fail deep inside the loader). A GGUF file: its
  architecture, tensor types and tensors (`gguf_import.GGUFCheckpoint`)."""
  from specjax.models.gguf_import import GGUFCheckpoint, gguf_path

  if gguf_path(path):
    GGUFCheckpoint(path)
    return
  if not os.path.isdir(path):
    raise UserError(f"--model-path {path}: " + ("not a directory" if os.path.exists(path) else
                                                "does not exist"))
  config = os.path.join(path, "config.json")
  if not os.path.isfile(config):
    raise UserError(f"--model-path {path}: no config.json")
  try:
    with open(config, encoding="utf-8") as f:
      json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise UserError(f"{config}: not valid JSON ({e})") from None
  from safetensors import safe_open

  files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
  if not files:
    raise UserError(f"--model-path {path}: no *.safetensors weights")
  for name in files:
    file = os.path.join(path, name)
    try:
      with safe_open(file, framework="numpy") as f:
        keys = list(f.keys())
        if keys:  # the last tensor ends at the file's end: a truncated file fails here
          f.get_slice(keys[-1])
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
      raise UserError(f"{file}: damaged safetensors file ({type(e).__name__}: {e})") from None


def check_policy(cfg: Any, policy_cfg: Any, tokenizer: Any, source: str) -> None:
  """The model against the tokenizer and the mesh: every token id has an embedding row; the
  tensor-parallel size fits the attention heads; the data-parallel shards divide the batch."""
  check(policy_cfg.vocab_size >= tokenizer.vocab_size, "ModelConfig.vocab_size",
        f"the model {source} has {policy_cfg.vocab_size} embedding rows but its tokenizer "
        f"{tokenizer.vocab_size} ids: ids >= {policy_cfg.vocab_size} would be out of range")
  meshes = []
  if cfg.async_rl.enabled:
    meshes = [("AsyncConfig.gen_mesh", cfg.async_rl.gen_mesh),
              ("AsyncConfig.train_mesh", cfg.async_rl.train_mesh)]
  elif cfg.rl.use_mesh:
    meshes = [("RLConfig.mesh", cfg.rl.mesh)]
  import jax

  n = jax.device_count()
  for where, mesh in meshes:
    devices = n
    if cfg.async_rl.enabled:
      gen = max(1, round(cfg.async_rl.gen_fraction * n))
      devices = gen if where.endswith("gen_mesh") else n - gen
    try:
      data, fsdp, tensor = mesh.resolve(devices)
    except UserError as e:  # its message names the mesh's shape, not which flag set it
      raise UserError(f"{where}: {e}") from None
    check(tensor <= policy_cfg.num_heads, f"{where}.tensor",
          f"tensor-parallel size {tensor} is larger than the model's {policy_cfg.num_heads} "
          f"attention heads")
    check(policy_cfg.num_heads % tensor == 0, f"{where}.tensor",
          f"tensor-parallel size {tensor} must divide the model's {policy_cfg.num_heads} heads")
    shards = data * fsdp
    check(cfg.rl.rollout_batch % shards == 0, f"{where}.data",
          f"the data-parallel shards (data {data} x fsdp {fsdp} = {shards}) must divide the "
          f"rollout batch prompts_per_step x group_size = {cfg.rl.rollout_batch}")


def check_kv_budget(cfg: Any, model_cfg: Any, task: Any) -> None:
  """RolloutConfig.engine.paging.kv_cache_gb against the least a row can need, before anything
  is built: the engine would refuse such a pool at the first rollout, minutes later
  (`paged_state.pool_size`, the same check). The bound is a prompt of the fixed width
  (max_prompt_len; else one token) + max_new_tokens, on pages of the policy's KV alone, split
  over as many devices as its kv heads could be: a pool refused here is refused there too."""
  r, paging = cfg.rl.rollout, cfg.rl.rollout.engine.paging
  if paging.kv_cache_gb <= 0:  # dense caches, or kv_cache_fraction: known at the first rollout
    return
  from specjax.sampling.engine.paged_state import bytes_per_page, pool_size

  split = 1
  if cfg.rl.use_mesh or cfg.async_rl.enabled:
    import jax

    split = max(1, min(model_cfg.num_kv_heads, jax.device_count()))
  page_bytes = bytes_per_page(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                              paging.page_size, model_cfg.compute_dtype) / split
  prompt = r.max_prompt_len or getattr(task, "max_prompt_len", 0) or 1
  pool_size(paging.kv_cache_gb, page_bytes, paging.page_size, prompt + r.max_new_tokens,
            field="RolloutConfig.engine.paging.kv_cache_gb",
            positions=f"a prompt of >= {prompt} + max_new_tokens {r.max_new_tokens}")
