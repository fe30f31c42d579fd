"""The draft the RL runs start from, built before RL: an EAGLE-3 head or an MTP module trained
offline on the base policy's own rollouts (cached under cache_dir), or what the draft method builds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import numpy as np
from flax import nnx

from specjax.config_tree import check
from specjax.jobs.base_policy import pretrain_model_cfg
from specjax.jobs.cache import cache_key, params_fingerprint, task_key, write_cache_entry
from specjax.jobs.config import ExperimentConfig

logger = logging.getLogger(__name__)


def general_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
  """A "general" prompt set for the out-of-domain draft comparison: word-like text."""
  rng = np.random.default_rng(seed)
  words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "home"]
  return [tokenizer.encode(" ".join(rng.choice(words, size=4)) + " ", bos=True) for _ in range(n)]


def _draft_init_prompts(cfg: ExperimentConfig, tokenizer, task):
  """(tokens, lengths) of the offline-draft prompts (`DraftInitConfig.domain`)."""
  from specjax.rl.rollout import pad_prompts

  d = cfg.draft_init
  if d.domain == "in-domain":
    prompts = [task.encode_prompt(e) for e in task.examples(10_000_000, d.prompts)]
  else:
    prompts = general_prompts(tokenizer, d.prompts, cfg.rl.seed)
  toks, lens, _ = pad_prompts(prompts, max(len(p) for p in prompts), tokenizer.pad_id)
  return np.asarray(toks), np.asarray(lens)


def build_draft_head(cfg: ExperimentConfig, policy, tokenizer, task):
  """Offline EAGLE-3 initialisation on the policy's rollouts (in-domain: the RL task's prompts;
  general: `general_prompts`, word-like text), cached under cache_dir. Returns (head, maps)."""
  from specjax.drafters.checkpoint import load_head, save_head
  from specjax.drafters.train import DraftTrainConfig, train_draft_head
  from specjax.rl.rollout import sampling_config

  d = cfg.draft_init
  graphdef, params = nnx.split(policy)
  # the rollouts' sampling settings, not the engine's (compaction, train widths, the draft
  # lengths it may pick): those do not change what the head is trained on; every kind that drafts
  # with a head (eagle3, eagle3-history) trains this one; its layer is Llama's (`init_head`)
  key = cache_key("draft", d, "eagle3", "llama-layer", cfg.rl.draft.ttt_steps,
                  sampling_config(cfg.rl, tokenizer), task_key(cfg.rl.task), policy.cfg,
                  params_fingerprint(params))
  path = os.path.join(cfg.cache_dir, f"eagle3-{key}")
  if os.path.isdir(path) and not cfg.fresh:
    logger.info(f"[draft] cached EAGLE-3 head {path}")
    return load_head(os.path.abspath(path), policy.cfg)
  toks, lens = _draft_init_prompts(cfg, tokenizer, task)
  t0 = time.perf_counter()
  logger.info(f"[draft] training an EAGLE-3 head on {len(toks)} {d.domain} rollouts "
              f"({d.steps} steps)")
  train_cfg = DraftTrainConfig(steps=d.steps, batch_size=d.batch_size, lr=d.lr,
                               ttt_steps=cfg.rl.draft.ttt_steps,
                               draft_vocab=d.draft_vocab or None, seed=cfg.rl.seed)
  head = None
  if d.head_mlp_hidden:
    from specjax.drafters.head import init_head

    check(d.draft_vocab > 0, "DraftInitConfig.draft_vocab",
          "set it with head_mlp_hidden (the head is built before the vocabulary is counted)")
    head = init_head(policy.cfg.replace(mlp_hidden=d.head_mlp_hidden), d.draft_vocab,
                     seed=cfg.rl.seed)
  target = draft_init_target(cfg, policy)
  result = train_draft_head(nnx.split(target), toks, lens, head=head,
                            sampling=sampling_config(cfg.rl, tokenizer), config=train_cfg,
                            progress=cfg.rl.progress)
  last = result.history[-1]
  logger.info(f"[draft] done in {time.perf_counter() - t0:.1f} s: TTT loss {last['loss']:.3f}, "
              f"step-0 top-1 agreement {last.get('acc_0', float('nan')):.2f}")
  write_cache_entry(path, lambda tmp: save_head(tmp, result.head, result.maps))
  return load_head(os.path.abspath(path), policy.cfg)


def draft_init_target(cfg: ExperimentConfig, policy):
  """The decoder the EAGLE-3 head is trained against offline: a grown base policy's exact
  pre-growth part (`grow.shrink_decoder`: the layers up to the last feature layer, the pretrained
  MLP units; same features, logits and rollouts, several times cheaper per step), else the
  policy itself."""
  small = pretrain_model_cfg(policy.cfg, cfg.base) if not cfg.model_path else policy.cfg
  if small is policy.cfg:
    return policy
  from specjax.jobs.grow import shrink_decoder

  layers = max(max(policy.cfg.aux_layer_ids) + 1, small.num_layers)
  target = shrink_decoder(policy, layers, small.mlp_hidden)
  if target is None:
    return policy
  logger.info(f"[draft] training against the policy's exact {target.cfg.num_params() / 1e6:.2f}"
              f"M-parameter pre-growth part ({layers} layers, MLP {small.mlp_hidden})")
  return target


def build_mtp_module(cfg: ExperimentConfig, policy, tokenizer, task):
  """Offline MTP training: the policy's MTP module alone (trunk frozen) on the policy's rollouts
  of the draft-init prompts; the trained module is cached under cache_dir. Returns the policy."""
  import jax
  from safetensors.numpy import load_file, save_file

  from specjax.drafters.train import collect_rollouts
  from specjax.jobs.pretrain import LmTrainConfig, train_lm
  from specjax.rl.rollout import sampling_config

  d = cfg.draft_init
  trunk = nnx.state(policy, nnx.Not(nnx.PathContains("mtp")))
  key = cache_key("mtp", d, sampling_config(cfg.rl, tokenizer), task_key(cfg.rl.task), policy.cfg,
                  params_fingerprint(trunk))
  path = os.path.join(cfg.cache_dir, f"mtp-{key}")
  file = os.path.join(path, "mtp.safetensors")
  if not (os.path.isfile(file) and not cfg.fresh):
    toks, lens = _draft_init_prompts(cfg, tokenizer, task)
    t0 = time.perf_counter()
    logger.info(f"[draft] training the MTP module on {len(toks)} {d.domain} rollouts "
                f"({d.steps} steps)")
    sampling = sampling_config(cfg.rl, tokenizer)
    rollouts = collect_rollouts(policy, toks, lens, jax.random.PRNGKey(cfg.rl.seed), sampling,
                                batch_size=d.batch_size)
    train_cfg = LmTrainConfig(steps=d.steps, batch_size=d.batch_size, lr=d.lr, mtp_only=True,
                              seed=cfg.rl.seed)
    trained, history = train_lm(policy, rollouts.tokens, rollouts.loss_mask, train_cfg,
                                progress=cfg.rl.progress)
    logger.info(f"[draft] done in {time.perf_counter() - t0:.1f} s: MTP loss "
                f"{history[-1]['loss']:.3f}, top-1 accuracy "
                f"{history[-1].get('mtp_acc', float('nan')):.2f}")
    flat = {"/".join(map(str, p)): np.asarray(jax.device_get(v.get_value()))
            for p, v in nnx.to_flat_state(nnx.state(trained, nnx.PathContains("mtp")))}
    write_cache_entry(path, lambda tmp: save_file(flat, os.path.join(tmp, "mtp.safetensors")))
  else:
    logger.info(f"[draft] cached MTP module {path}")
  saved = load_file(file)
  state = nnx.state(policy, nnx.PathContains("mtp"))
  for p, v in nnx.to_flat_state(state):
    v.set_value(jax.numpy.asarray(saved["/".join(map(str, p))], v.get_value().dtype))
  nnx.update(policy, state)
  return policy


@dataclasses.dataclass(frozen=True)
class _OfflineEnv:
  """The experiment's side of `specjax.drafters.methods.OfflineEnv`: the cached offline trainers
  above, and this module's logger."""

  cfg: ExperimentConfig
  tokenizer: Any
  task: Any
  policy_dir: str

  @property
  def draft_model_layers(self) -> int:
    return self.cfg.draft_init.draft_model_layers

  def log(self, message: str) -> None:
    logger.info(message)

  def train_eagle3(self, policy):
    return build_draft_head(self.cfg, policy, self.tokenizer, self.task)

  def train_mtp(self, policy):
    return build_mtp_module(self.cfg, policy, self.tokenizer, self.task)


def build_offline_draft(cfg: ExperimentConfig, policy, tokenizer, task, policy_dir: str):
  """The draft the RL runs start from, as the draft method builds it (`OfflineDraft`)."""
  env = _OfflineEnv(cfg, tokenizer, task, policy_dir)
  return cfg.rl.draft.method.offline_draft(cfg.rl.draft, policy, env)
