"""Offline initialisation of the EAGLE-3 head: target rollouts on a prompt set, then TTT training.

The prompt set decides the draft's domain: the RL task's prompts (in-domain) or any other set
("general"). Optimiser: `specjax.optim`'s, warmup (`default_warmup` unless set) + cosine.

The target is frozen, so by default its features on the rollouts are computed once
(`features.py`: one forward per rollout, held on the host) and each step runs the head alone;
`precompute_features=False` runs the target inside every step instead (the same loss up to
float rounding, at the cost of the target's layers per step).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from specjax.config_tree import check
from specjax.drafters.features import (TargetFeatures, batch_width, compute_features,
                                       feature_nbytes, loss_positions, ttt_loss_from_features)
from specjax.drafters.head import Eagle3Head, init_head
from specjax.drafters.ttt import ttt_loss
from specjax.drafters.vocab import VocabMaps, build_vocab_maps_from_tokens
from specjax.optim import check_trainer_fields, trainer_transform
from specjax.sampling.ar import generate
from specjax.sampling.core import SamplingConfig, split_model

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DraftTrainConfig:
  steps: int = 300
  batch_size: int = 16
  lr: float = 3e-3
  warmup_steps: int | None = None  # None: specjax.optim.default_warmup(steps)
  final_lr_ratio: float = 0.1  # cosine decays to lr * final_lr_ratio
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  ttt_steps: int = 3
  step_decay: float = 0.8
  draft_vocab: int | None = None  # None -> min(V, 32000)
  samples_per_prompt: int = 1
  rollout_batch: int = 64
  seed: int = 0
  # the target's features computed once and reused by every step (the default: exact, and a
  # step then costs the head alone); False: the target runs inside each step
  precompute_features: bool = True
  # above this many GiB of host memory for the features, the target runs inside each step
  max_feature_gib: float = 8.0

  def __post_init__(self):
    w = "DraftTrainConfig"
    check_trainer_fields(self, w)
    check(self.ttt_steps >= 1, f"{w}.ttt_steps", f"must be >= 1, got {self.ttt_steps}")
    check(0 < self.step_decay <= 1, f"{w}.step_decay", f"must lie in (0, 1], got {self.step_decay}")
    check(self.draft_vocab is None or self.draft_vocab >= 1, f"{w}.draft_vocab",
          f"must be None or >= 1, got {self.draft_vocab}")
    check(self.samples_per_prompt >= 1, f"{w}.samples_per_prompt",
          f"must be >= 1, got {self.samples_per_prompt}")
    check(self.rollout_batch >= 1, f"{w}.rollout_batch", f"must be >= 1, got {self.rollout_batch}")
    check(self.max_feature_gib > 0, f"{w}.max_feature_gib",
          f"must be > 0, got {self.max_feature_gib}")


@dataclasses.dataclass
class Rollouts:
  """Sequences (prompt + completion, padded) and the mask of completion tokens, on the host."""

  tokens: np.ndarray  # int32[M, W]
  loss_mask: np.ndarray  # bool[M, W]


def collect_rollouts(target, prompts, prompt_lengths, key: jax.Array, sampling: SamplingConfig, *,
                     samples_per_prompt: int = 1, batch_size: int = 64,
                     progress: bool = False) -> Rollouts:
  """Sample `samples_per_prompt` completions per prompt with the AR sampler, in fixed-size batches
  (the last one wraps around, so one program is compiled)."""
  prompts = np.repeat(np.asarray(prompts, np.int32), samples_per_prompt, axis=0)
  lengths = np.repeat(np.asarray(prompt_lengths, np.int32), samples_per_prompt, axis=0)
  m = prompts.shape[0]
  batch = min(batch_size, m)
  seqs, masks = [], []
  for i, start in enumerate(tqdm(range(0, m, batch), desc="rollouts", disable=not progress)):
    idx = np.arange(start, start + batch) % m
    out = generate(target, prompts[idx], lengths[idx], jax.random.fold_in(key, i), sampling)
    keep = min(batch, m - start)
    width = out.sequences.shape[1]
    completion = (np.asarray(out.sequence_mask)
                  & (np.arange(width)[None, :] >= np.asarray(out.prompt_lengths)[:, None]))
    seqs.append(np.asarray(out.sequences)[:keep])
    masks.append(completion[:keep])
  return Rollouts(tokens=np.concatenate(seqs), loss_mask=np.concatenate(masks))


@functools.partial(jax.jit, static_argnames=("head_graphdef", "target_graphdef", "cfg"))
def draft_train_step(head_graphdef, target_graphdef, cfg: DraftTrainConfig, head_params, opt_state,
                     target_params, maps: VocabMaps, tokens, loss_mask):
  """One AdamW step of the TTT loss on a batch; the target runs forward only."""
  target = nnx.merge(target_graphdef, target_params)
  out = target(tokens)
  embed = target.embed[...]

  def loss_fn(p):
    return ttt_loss(head_graphdef, p, embed, out.aux_hidden, out.logits, tokens, loss_mask, maps,
                    num_steps=cfg.ttt_steps, step_decay=cfg.step_decay)

  return _adamw_step(cfg, loss_fn, head_params, opt_state)


@functools.partial(jax.jit, static_argnames=("head_graphdef", "cfg"))
def feature_train_step(head_graphdef, cfg: DraftTrainConfig, head_params, opt_state, embed,
                       lm_head, maps: VocabMaps, aux_hidden, final_hidden, target_argmax, tokens,
                       loss_mask, positions):
  """`draft_train_step` on precomputed target features (`features.py`): the head alone runs;
  `embed` [V, d] and `lm_head` [d, V] are the target's, `positions` `loss_positions(loss_mask)`."""

  def loss_fn(p):
    return ttt_loss_from_features(head_graphdef, p, embed, lm_head, aux_hidden, final_hidden,
                                  target_argmax, tokens, loss_mask, maps, positions,
                                  num_steps=cfg.ttt_steps, step_decay=cfg.step_decay)

  return _adamw_step(cfg, loss_fn, head_params, opt_state)


def _adamw_step(cfg: DraftTrainConfig, loss_fn, head_params, opt_state):
  """Gradient of `loss_fn(head_params) -> (loss, metrics)` and the optimiser's update."""
  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(head_params)
  updates, opt_state = trainer_transform(cfg).update(grads, opt_state, head_params)
  grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
  metrics = dict(metrics, grad_norm=grad_norm)
  return optax.apply_updates(head_params, updates), opt_state, metrics


@dataclasses.dataclass
class DraftTrainResult:
  head: Eagle3Head
  maps: VocabMaps
  history: list[dict[str, float]]  # metrics of every step
  rollouts: Rollouts
  feature_bytes: int | None = None  # host bytes of the precomputed features; None: not used
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # features, steps (wall)


def train_draft_head(target, prompts=None, prompt_lengths=None, *,
                     sampling: SamplingConfig | None = None,
                     config: DraftTrainConfig = DraftTrainConfig(),
                     head: Eagle3Head | None = None, maps: VocabMaps | None = None,
                     rollouts: Rollouts | None = None, key: jax.Array | None = None,
                     progress: bool = True) -> DraftTrainResult:
  """Train a draft head for `target` (a Decoder or its (graphdef, params)).

  (a) rollouts of the target on `prompts` (or the given `rollouts`), (b) the target's features on
  them, computed once (`config.precompute_features`, within `config.max_feature_gib`) or inside
  each step, (c) `config.steps` TTT steps on random minibatches. `maps`
  default to the top `config.draft_vocab` completion tokens (EOS ids always kept); `head` to a
  fresh one. Returns the trained head (a new module; `head` is left as it was).
  """
  graphdef, params = split_model(target)
  model_cfg = nnx.merge(graphdef, params).cfg
  key = jax.random.key(config.seed) if key is None else key
  if rollouts is None:
    if prompts is None or sampling is None:
      raise ValueError("train_draft_head: pass prompts, prompt_lengths and sampling, or rollouts")
    rollouts = collect_rollouts((graphdef, params), prompts, prompt_lengths,
                                jax.random.fold_in(key, 1), sampling,
                                samples_per_prompt=config.samples_per_prompt,
                                batch_size=config.rollout_batch, progress=progress)
  if maps is None:
    eos = sampling.eos_ids if sampling is not None else ()
    maps = build_vocab_maps_from_tokens(rollouts.tokens, model_cfg.vocab_size, config.draft_vocab,
                                        mask=rollouts.loss_mask, always_include=eos)
  if head is None:
    head = init_head(model_cfg, maps.draft_vocab, seed=config.seed)
  if head.cfg.draft_vocab != maps.draft_vocab:
    raise ValueError(f"train_draft_head: head has {head.cfg.draft_vocab} draft ids, maps "
                     f"{maps.draft_vocab}")
  head_graphdef, head_params = nnx.split(head)
  opt_state = trainer_transform(config).init(head_params)
  start = time.perf_counter()
  features = _features((graphdef, params), model_cfg, rollouts, config, progress)
  seconds = {"features": time.perf_counter() - start}
  if features is not None:
    model = nnx.merge(graphdef, params)
    embed, lm_head = model.embed[...], model.head_weight()
  rng = np.random.default_rng(config.seed)
  m = rollouts.tokens.shape[0]
  history = []
  bar = tqdm(range(config.steps), desc="draft head", disable=not progress)
  for _ in bar:
    idx = rng.choice(m, size=config.batch_size, replace=m < config.batch_size)
    if features is None:
      head_params, opt_state, metrics = draft_train_step(
          head_graphdef, graphdef, config, head_params, opt_state, params, maps,
          jnp.asarray(rollouts.tokens[idx]), jnp.asarray(rollouts.loss_mask[idx]))
    else:
      width = batch_width(rollouts.loss_mask[idx])
      mask = rollouts.loss_mask[idx, :width]
      head_params, opt_state, metrics = feature_train_step(
          head_graphdef, config, head_params, opt_state, embed, lm_head, maps,
          *features.take(idx, width), rollouts.tokens[idx, :width], mask,
          loss_positions(mask, config.ttt_steps))
    history.append(metrics)
    if progress:
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", acc0=f"{float(metrics['acc_0']):.2f}")
  history = [{k: float(v) for k, v in h.items()} for h in jax.device_get(history)]
  seconds["steps"] = time.perf_counter() - start - seconds["features"]
  return DraftTrainResult(head=nnx.merge(head_graphdef, head_params), maps=maps, history=history,
                          rollouts=rollouts,
                          feature_bytes=None if features is None else features.nbytes,
                          seconds=seconds)


def _features(target, model_cfg, rollouts: Rollouts, config: DraftTrainConfig,
              progress: bool) -> TargetFeatures | None:
  """The target's features on the rollouts, or None where they are not precomputed (off, or over
  `config.max_feature_gib` of host memory: then the target runs inside each step)."""
  if not config.precompute_features:
    return None
  rows, width = rollouts.tokens.shape
  need = feature_nbytes(model_cfg, rows, width)
  if need > config.max_feature_gib * 2**30:
    logger.warning(f"draft head: target features would take {need / 2**30:.1f} GiB of host "
                   f"memory (max_feature_gib={config.max_feature_gib}); the target runs inside "
                   f"each step instead")
    return None
  features = compute_features(target, rollouts.tokens, batch_size=config.batch_size,
                              progress=progress)
  logger.info(f"draft head: target features of {rows} rollouts x {width} positions, "
              f"{features.nbytes / 2**20:.1f} MiB on the host")
  return features


@functools.partial(jax.jit, static_argnames=("head_graphdef", "target_graphdef", "num_steps"))
def _eval_ttt(head_graphdef, target_graphdef, num_steps, head_params, target_params, maps, tokens,
              loss_mask):
  model = nnx.merge(target_graphdef, target_params)
  out = model(tokens)
  return ttt_loss(head_graphdef, head_params, model.embed[...], out.aux_hidden, out.logits, tokens,
                  loss_mask, maps, num_steps=num_steps)[1]


def eval_ttt(target, head: Eagle3Head, maps: VocabMaps, rollouts: Rollouts, *,
             num_steps: int = 3) -> dict[str, float]:
  """TTT metrics (per-step loss and top-1 agreement) of a head on held-out rollouts."""
  graphdef, params = split_model(target)
  head_graphdef, head_params = nnx.split(head)
  metrics = _eval_ttt(head_graphdef, graphdef, num_steps, head_params, params, maps,
                      jnp.asarray(rollouts.tokens), jnp.asarray(rollouts.loss_mask))
  return {k: float(v) for k, v in metrics.items()}
