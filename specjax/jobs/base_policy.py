"""The policy RL starts from: a local Hugging Face checkpoint, or a small decoder pretrained here on
the task's text (optionally grown to the RL model's size), cached under cache_dir.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np
from flax import nnx

from specjax.jobs.cache import cache_key, task_key, write_cache_entry
from specjax.jobs.config import BaseModelConfig, Examples, ExperimentConfig

logger = logging.getLogger(__name__)


def biased_answer(example, rng: np.random.Generator, bias: float) -> str:
  """The example's answer, or with probability `bias` the systematic mistake answer + 1."""
  return str(int(example.answer) + 1) if rng.random() < bias else example.answer


def policy_model_cfg(cfg: ExperimentConfig, tokenizer):
  """--rl.model, with at least one embedding row per token id of `tokenizer`."""
  m = cfg.rl.model
  if m.vocab_size < tokenizer.vocab_size:
    m = m.replace(vocab_size=tokenizer.vocab_size)
  return m


def pretrain_model_cfg(model_cfg, base: BaseModelConfig):
  """The config the base policy is pretrained at: `model_cfg` with BaseModelConfig's
  pretrain_layers / pretrain_mlp_hidden (then grown to `model_cfg`), or `model_cfg` itself."""
  layers = base.pretrain_layers or model_cfg.num_layers
  mlp = base.pretrain_mlp_hidden or model_cfg.mlp_hidden
  if (layers, mlp) == (model_cfg.num_layers, model_cfg.mlp_hidden):
    return model_cfg
  from specjax.jobs.grow import check_growth

  small = model_cfg.replace(num_layers=layers, mlp_hidden=mlp, aux_layers=None)
  check_growth(small, model_cfg)
  return small


def _pretrain(model_cfg, examples: list, tokenizer, base: BaseModelConfig, steps: int, seed: int,
              start=None, *, progress: bool):
  from specjax.jobs.pretrain import pretrain_lm
  from specjax.models import Decoder

  model = start if start is not None else Decoder(model_cfg, rngs=nnx.Rngs(seed))
  model, history = pretrain_lm(model, examples, tokenizer, steps=steps,
                               batch_size=base.batch_size, lr=base.lr,
                               warmup_steps=min(base.warmup_steps, steps - 1), seed=seed,
                               length_batches=base.length_batches, progress=progress)
  return model, history


def build_base_policy(cfg: ExperimentConfig, tokenizer, task, base_examples: Examples,
                      finetune_examples: Examples | None = None):
  """The policy RL starts from: a local HF checkpoint, or a small decoder pretrained here on the
  task's text (and, for rl_think, fine-tuned on scratchpad text), cached under cache_dir; loaded
  with what the draft method needs of it (an MTP module, a published head's aux layers)."""
  path = base_policy_dir(cfg, tokenizer, task, base_examples, finetune_examples)
  return load_base_policy(cfg, tokenizer, path)


def load_base_policy(cfg: ExperimentConfig, tokenizer, path: str):
  """The base policy at `path` (see `base_policy_dir`), with the draft method's overrides."""
  from specjax.models import load_pretrained

  overrides = cfg.rl.draft.method.policy_overrides(cfg.rl.draft, path)
  if cfg.model_path:
    logger.info(f"[base] loading {cfg.model_path}")
    return load_pretrained(cfg.model_path, dtype=cfg.rl.model.dtype, **overrides)
  model_cfg = policy_model_cfg(cfg, tokenizer)
  overrides = dict(dict(aux_layers=model_cfg.aux_layers, mtp=model_cfg.mtp,
                        init_std=model_cfg.init_std, param_dtype=model_cfg.param_dtype),
                   **overrides)
  return load_pretrained(path, dtype=model_cfg.dtype, **overrides)


def base_policy_dir(cfg: ExperimentConfig, tokenizer, task, base_examples: Examples,
                    finetune_examples: Examples | None = None) -> str:
  """The Hugging Face directory of the base policy: --model-path, or the cached pretrained one
  (built here first when absent)."""
  from specjax.models import save_pretrained

  if cfg.model_path:
    return cfg.model_path
  model_cfg = policy_model_cfg(cfg, tokenizer)
  seed = cfg.base.seed if cfg.base.seed >= 0 else cfg.rl.seed
  # aux_layers only picks which hidden states a forward exports: not part of the weights' key
  key = cache_key("base", model_cfg.replace(aux_layers=None),
                  dataclasses.replace(cfg.base, seed=seed), task_key(cfg.rl.task), seed,
                  finetune_examples is not None)
  path = os.path.join(cfg.cache_dir, f"base-{key}")
  if os.path.isdir(path) and not cfg.fresh:
    logger.info(f"[base] cached base policy {path}")
    return path
  t0 = time.perf_counter()
  small_cfg = pretrain_model_cfg(model_cfg, cfg.base)
  logger.info(f"[base] pretraining a {small_cfg.num_params() / 1e6:.2f}M-parameter decoder on the "
              f"task's text ({cfg.base.steps} steps)")
  model, _ = _pretrain(small_cfg, base_examples(task, cfg.base.examples, seed, cfg.base.bias),
                       tokenizer, cfg.base, cfg.base.steps, seed, progress=cfg.rl.progress)
  if finetune_examples is not None and cfg.base.finetune_steps:
    logger.info(f"[base] fine-tuning on scratchpad text ({cfg.base.finetune_steps} steps)")
    texts = finetune_examples(task, cfg.base.examples, seed + 1, cfg.base.bias)
    model, _ = _pretrain(small_cfg, texts, tokenizer, cfg.base, cfg.base.finetune_steps, seed + 1,
                         start=model, progress=cfg.rl.progress)
  if small_cfg is not model_cfg:
    from specjax.jobs.grow import grow_decoder

    model = grow_decoder(model, model_cfg, seed=seed)
    logger.info(
        f"[base] grown function-preservingly to {model_cfg.num_params() / 1e6:.2f}M parameters "
        f"({small_cfg.num_layers} -> {model_cfg.num_layers} layers, MLP {small_cfg.mlp_hidden} -> "
        f"{model_cfg.mlp_hidden}; new layers and units start with zero output projections)")
  write_cache_entry(path, lambda tmp: save_pretrained(model, tmp))
  logger.info(f"[base] done in {time.perf_counter() - t0:.1f} s, cached at {path}")
  return path
