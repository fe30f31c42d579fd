"""The RL train step: one jitted SPMD program for the GRPO policy update and the online draft update.

loss = GRPO(policy) + lambda * TTT(draft; stop_gradient(aux_hidden, logits, embedding)); one optax
`multi_transform` with its own schedule, clipping and AdamW per group ("policy", "draft";
`specjax.rl.train_state`), so the draft learns without changing a bit of the policy update. Also:
the training-side logprob forward. Packed batches: `specjax.rl.train_packed`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from specjax.optim import OptimConfig, make_schedule
from specjax.rl.config import RLConfig
from specjax.rl.grpo import GRPOConfig, denominators, grpo_loss
from specjax.rl.logprobs import policy_logprobs
from specjax.rl.train_packed import accumulate_metric, packed_step
from specjax.rl.train_state import (GROUPS, TrainBatch, TrainState, make_optimizer,
                                    shard_train_batch, train_state_shardings)
from specjax.drafters.methods import DraftLossInputs, DraftMethod


# metrics of the work a step did, which add up over an optimizer step's minibatches
SUMMED_METRICS = ("train/tokens", "train/attention_pairs", "train/packed_rows")


@dataclasses.dataclass(frozen=True)
class TrainStepConfig:
  """Exactly the parts of `RLConfig` the train step reads: a static argument of its jitted
  functions (hashed by value), so a field it reads can never be missing from the cache key."""

  grpo: GRPOConfig
  policy_optim: OptimConfig
  draft_optim: OptimConfig
  optimizer_steps: int  # span of the learning-rate schedules
  minibatches: int  # optimizer steps per rollout batch
  micro_batches: int  # gradient accumulation inside each optimizer step
  temperature: float  # of the training-side logprobs (1.0 unless they follow the sampler's)
  draft_method: DraftMethod
  draft_online: bool  # the draft group learns from the method's online loss (DraftConfig checks
  # that the method has one)
  draft_loss_weight: float  # default lambda
  ttt_steps: int  # EAGLE-3 TTT unroll of the online loss
  loss_norm_len: int  # Dr.GRPO's constant length (loss_agg seq-mean-token-sum-norm)
  # sequence packing (TrainConfig.packing, `specjax.rl.train_packed`): rows of pack_width
  # positions (0: the batch's width), pack_rows rows per micro-batch; pack_rows 0: no packing
  pack_width: int = 0
  pack_rows: int = 0
  # packed steps leave out sequences whose advantages are all exactly 0 (TrainConfig.
  # skip_zero_advantage, and only while beta == 0: the KL term reads every sequence)
  skip_zero_advantage: bool = False

  @classmethod
  def from_rl(cls, cfg: RLConfig) -> "TrainStepConfig":
    r, d, t = cfg.rollout, cfg.draft, cfg.train
    return cls(grpo=cfg.grpo, policy_optim=cfg.policy_optim, draft_optim=cfg.draft_optim,
               optimizer_steps=cfg.optimizer_steps, minibatches=cfg.minibatches,
               micro_batches=cfg.micro_batches,
               temperature=r.temperature if t.temperature and r.temperature > 0 else 1.0,
               draft_method=d.method, draft_online=d.online,
               draft_loss_weight=d.loss_weight, ttt_steps=d.ttt_steps,
               loss_norm_len=r.max_new_tokens, pack_width=t.pack_width,
               pack_rows=t.pack_rows if cfg.packs_train_batch else 0,
               skip_zero_advantage=t.skip_zero_advantage and cfg.grpo.beta == 0)


@dataclasses.dataclass(frozen=True)
class Trainer:
  """Static parts of the train step (its `TrainStepConfig`, graphdefs, mesh) and its jitted
  functions. Built from an `RLConfig`; hashed and compared by value (the step config, graphdefs,
  mesh): the module-level jitted functions below take the trainer as a static argument, so equal
  trainers (e.g. a resumed run) share compiled programs.

  The "draft" group holds what the draft method trains online (`DraftMethod.init`): an EAGLE-3
  head (`draft_graphdef`), the policy's own MTP module split off the policy state, or nothing.
  """

  cfg: dataclasses.InitVar[RLConfig]
  policy_graphdef: Any
  draft_graphdef: Any = None
  mesh: Mesh | None = None
  step_cfg: TrainStepConfig = dataclasses.field(init=False)
  # micro-batch signatures (structure and shapes) the packed step has accumulated once, so that
  # a step with nothing to train skips them (`train_packed.packed_step`); not part of equality
  accumulated: set = dataclasses.field(default_factory=set, init=False, repr=False,
                                       compare=False)

  def __post_init__(self, cfg: RLConfig):
    object.__setattr__(self, "step_cfg", TrainStepConfig.from_rl(cfg))

  @property
  def tx(self) -> optax.GradientTransformation:
    c = self.step_cfg
    return make_optimizer(c.policy_optim, c.draft_optim, c.optimizer_steps)

  @property
  def schedules(self) -> dict[str, optax.Schedule]:
    c = self.step_cfg
    return {"policy": make_schedule(c.policy_optim, c.optimizer_steps),
            "draft": make_schedule(c.draft_optim, c.optimizer_steps)}

  @property
  def method(self) -> DraftMethod:
    return self.step_cfg.draft_method

  @property
  def online(self) -> bool:
    return self.step_cfg.draft_online

  def forward_params(self, params: dict) -> Any:
    """The state the policy forward merges from (`DraftMethod.forward_params`)."""
    return self.method.forward_params(params)

  # -- state ---------------------------------------------------------------------------------
  def init_state(self, policy_params, draft_params=None, draft_aux=()) -> TrainState:
    params = {"policy": policy_params, "draft": draft_params if draft_params is not None else {}}
    # buffers of its own: donated steps (`step(donate=True)`) must not delete the caller's arrays
    params = jax.tree.map(jnp.copy, params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                       opt_state=self.tx.init(params), draft_aux=draft_aux)
    return self.place(state)

  def place(self, state: TrainState) -> TrainState:
    """Put a state on this trainer's mesh, or commit it to the default device: a fresh and a
    restored state (orbax returns committed arrays) then hit the same compiled programs."""
    if self.mesh is None:
      return jax.device_put(state, jax.devices()[0])
    return jax.device_put(state, train_state_shardings(state, self.mesh))

  def place_batch(self, batch: TrainBatch) -> TrainBatch:
    return batch if self.mesh is None else shard_train_batch(batch, self.mesh)

  # -- pure functions ------------------------------------------------------------------------
  @property
  def temperature(self) -> float:
    return self.step_cfg.temperature

  def _forward(self, forward_params, tokens, positions=None, segment_ids=None):
    model = nnx.merge(self.policy_graphdef, forward_params)
    return model, model(tokens, positions=positions, segment_ids=segment_ids,
                        compute_logits=not model.cfg.logits_chunk)

  def _logprobs(self, forward_params, tokens):
    model, out = self._forward(forward_params, tokens)
    return policy_logprobs(model, out, tokens, self.temperature)[0]

  def _loss(self, params, batch: TrainBatch, draft_aux, draft_weight, denom):
    c = self.step_cfg
    model, out = self._forward(self.forward_params(params), batch.tokens, batch.positions,
                               batch.segment_ids)
    lp, entropy = policy_logprobs(model, out, batch.tokens, self.temperature)
    mask = batch.loss_mask.astype(jnp.float32)
    ref = batch.ref_logprobs if c.grpo.beta > 0 else None
    # on-policy: old == current policy, so the forward of this step is also the old-logprob pass
    old = jax.lax.stop_gradient(lp) if batch.old_logprobs is None else batch.old_logprobs
    loss, metrics = grpo_loss(lp, old, batch.advantages, mask, c.grpo, ref,
                              denom, pg_weights=batch.pg_weights, seq_lengths=batch.seq_lengths)
    metrics["entropy"] = jnp.sum(jax.lax.stop_gradient(entropy) * mask) / denom.metric_denominator
    if batch.sampler_logprobs is not None:
      delta = jnp.abs(jax.lax.stop_gradient(lp) - batch.sampler_logprobs) * mask
      metrics["mismatch/mean_abs"] = jnp.sum(delta) / denom.metric_denominator
      metrics["mismatch/max_abs"] = jnp.max(delta)
    if self.online:
      draft_loss, dm = self.method.online_loss(DraftLossInputs(
          params=params, embed=model.embed[...], out=out, tokens=batch.tokens, mask=mask,
          draft_aux=draft_aux, policy_graphdef=self.policy_graphdef,
          draft_graphdef=self.draft_graphdef, ttt_steps=c.ttt_steps))
      # the online losses are means over their (micro-)batch: weight each by its share of the
      # batch's completion tokens, so micro-batches sum to the full-batch mean
      share = mask.sum() / denom.tokens if self._micro > 1 else 1.0
      loss = loss + draft_weight * share * draft_loss
      metrics.update({f"draft/{k}": v / self._micro for k, v in dm.items()})
    return loss, metrics

  @property
  def _micro(self) -> int:
    return self.step_cfg.micro_batches

  def _grads(self, state: TrainState, batch: TrainBatch, draft_weight, denom=None):
    """(grads, metrics) summed over `micro_batches` micro-batches (lax.scan); `denom` those of
    the whole batch when `batch` is one packed micro-batch of it."""
    if denom is None:
      denom = denominators(batch.loss_mask.astype(jnp.float32), self.step_cfg.loss_norm_len)
    grad_fn = jax.grad(self._loss, has_aux=True)
    m = 1 if batch.segment_ids is not None else self._micro  # packed: micro-batches already
    if m == 1:
      return grad_fn(state.params, batch, state.draft_aux, draft_weight, denom)
    micro = jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), batch)

    def body(acc, mb):
      g, met = grad_fn(state.params, mb, state.draft_aux, draft_weight, denom)
      grads = jax.tree.map(jnp.add, acc[0], g)
      return (grads, {k: accumulate_metric(k, acc[1][k], v) for k, v in met.items()}), None

    zeros_g = jax.tree.map(jnp.zeros_like, state.params)
    shapes = jax.eval_shape(lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], micro),
                                            state.draft_aux, draft_weight, denom)[1])
    zeros_m = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (grads, metrics), _ = jax.lax.scan(body, (zeros_g, zeros_m), micro)
    return grads, metrics

  def _train_step(self, state: TrainState, batch: TrainBatch, draft_weight):
    draft_weight = jnp.asarray(draft_weight, jnp.float32)
    grads, metrics = self._grads(state, batch, draft_weight)
    return self._apply(state, grads, metrics, draft_weight)

  def _apply(self, state: TrainState, grads, metrics, draft_weight):
    """The optimizer update of summed `grads`: (new state, metrics)."""
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # lambda == 0, or no online draft loss (an offline head rides in the state for the sampler):
    # the draft (params and its optimizer state) stays exactly as it was, weight decay included
    keep = ((lambda new, old: jax.tree.map(lambda n, o: jnp.where(draft_weight > 0, n, o), new,
                                           old)) if self.online else (lambda new, old: old))
    params = dict(params, draft=keep(params["draft"], state.params["draft"]))
    inner = dict(opt_state.inner_states)
    inner["draft"] = keep(inner["draft"], state.opt_state.inner_states["draft"])
    opt_state = opt_state._replace(inner_states=inner)
    for g in GROUPS:
      if jax.tree.leaves(grads[g]):
        metrics[f"grad_norm/{g}"] = optax.tree.norm(grads[g])
      metrics[f"lr/{g}"] = self.schedules[g](state.step)
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                     draft_aux=state.draft_aux)
    if self.mesh is not None:
      new = jax.lax.with_sharding_constraint(new, train_state_shardings(new, self.mesh))
    return new, metrics

  # -- public entry points -----------------------------------------------------------------
  def step(self, state: TrainState, batch: TrainBatch, draft_weight: float | None = None, *,
           donate: bool = False) -> tuple[TrainState, dict]:
    """One optimizer step; `draft_weight` (lambda) defaults to DraftConfig.loss_weight. With
    `donate` the step reuses the buffers of `state` for the new state (params and optimizer
    state are not held twice); `state` is invalid afterwards."""
    w = self.step_cfg.draft_loss_weight if draft_weight is None else draft_weight
    if self.packing:
      return packed_step(self, state, batch, jnp.float32(w), donate)
    from specjax.rl.packing import attention_work

    fn = _step_jit_donated if donate else _step_jit
    new, metrics = fn(self, state, self.place_batch(batch), jnp.float32(w))
    # for the step's model FLOPs, as the packed step counts them: positions and causal pairs
    # of the sequences up to their last loss position (where this process holds the whole
    # batch: across processes each holds only its rows, and the figures are left out)
    mask = batch.loss_mask
    if not isinstance(mask, jax.Array) or mask.is_fully_addressable:
      metrics = dict(metrics)
      metrics["train/tokens"], metrics["train/attention_pairs"] = attention_work(
          np.asarray(jax.device_get(mask)))
    return new, metrics

  @property
  def packing(self) -> bool:
    """Train on packed rows (`RLConfig.packs_train_batch`); in one process only: packing reads
    the whole batch on the host, and across processes each holds only its own rows."""
    return self.step_cfg.pack_rows > 0 and jax.process_count() == 1

  @property
  def pack_rows(self) -> int:
    """Rows per packed micro-batch: a multiple of the mesh's data-parallel size."""
    from specjax.sampling.buckets import data_parallel_size
    dp = data_parallel_size(self.mesh)
    return -(-self.step_cfg.pack_rows // dp) * dp

  def train_on_batch(self, state: TrainState, batch: TrainBatch, *,
                     donate: bool = False) -> tuple[TrainState, dict]:
    """RLConfig.minibatches optimizer steps on consecutive slices of a rollout batch, all against
    the same old logprobs (later slices see ratios != 1, so clipping matters); mean metrics."""
    n = self.step_cfg.minibatches
    if n == 1:
      return self.step(state, batch, donate=donate)
    if batch.old_logprobs is None:
      raise ValueError("train_on_batch: minibatches > 1 needs old_logprobs (later minibatches "
                       "are off-policy)")
    rows = batch.tokens.shape[0] // n
    history = []
    for i in range(n):
      state, m = self.step(state, jax.tree.map(lambda x: x[i * rows:(i + 1) * rows], batch),
                           donate=donate)
      history.append(m)
    # a minibatch that trains on no sequence has no token-mean metrics: mean over those that do;
    # the work done (SUMMED_METRICS) adds up over the minibatches
    keys = dict.fromkeys(k for m in history for k in m)
    return state, {k: (jnp.sum if k in SUMMED_METRICS else jnp.mean)(
        jnp.stack([jnp.asarray(m[k]) for m in history if k in m])) for k in keys}

  def apply_grads(self, state: TrainState, grads, metrics, draft_weight, *,
                  donate: bool = False) -> tuple[TrainState, dict]:
    """The optimizer update of summed `grads` (`donate`: in the buffers of `state`)."""
    fn = _apply_jit_donated if donate else _apply_jit
    return fn(self, state, grads, metrics, draft_weight)

  def grads(self, state: TrainState, batch: TrainBatch, draft_weight: float | None = None):
    w = self.step_cfg.draft_loss_weight if draft_weight is None else draft_weight
    return _grads_jit(self, state, self.place_batch(batch), jnp.float32(w))

  def logprobs(self, forward_params, tokens: jax.Array) -> jax.Array:
    """Training-side logprobs [B, S] of a batch of sequences (old / reference logprobs);
    `forward_params` is `forward_params(state.params)` (the policy state for most methods)."""
    if self.mesh is not None:
      from specjax.sharding import shard_batch
      tokens = shard_batch(tokens, self.mesh)
    return _logprobs_jit(self, forward_params, tokens)


_step_jit = jax.jit(lambda t, *args: t._train_step(*args), static_argnums=0)
_step_jit_donated = jax.jit(lambda t, *args: t._train_step(*args), static_argnums=0,
                            donate_argnums=1)
_grads_jit = jax.jit(lambda t, *args: t._grads(*args), static_argnums=0)
_apply_jit = jax.jit(lambda t, *args: t._apply(*args), static_argnums=0)
_apply_jit_donated = jax.jit(lambda t, *args: t._apply(*args), static_argnums=0,
                             donate_argnums=1)
_logprobs_jit = jax.jit(lambda t, *args: t._logprobs(*args), static_argnums=0)

