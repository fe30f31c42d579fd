"""The one optimizer of every trainer in specjax: global-norm clipping + AdamW on a warmup + decay
schedule (`OptimConfig`, `make_transform`), and the one warmup rule of the short offline trainers.
"""

from __future__ import annotations

import dataclasses

import optax

from specjax.config_tree import check, one_of

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with warmup + schedule and global-norm clipping (one per parameter group)."""

  lr: float = 1e-6
  warmup_steps: int = 0
  schedule: str = "constant"
  decay_steps: int = 0  # steps of the cosine/linear decay after warmup; 0 -> the rest of the run
  final_lr_ratio: float = 0.0
  clip_norm: float = 1.0  # 0 disables clipping
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8

  def __post_init__(self):
    w = "OptimConfig"
    check(self.lr >= 0, f"{w}.lr", f"must be >= 0, got {self.lr}")
    check(self.warmup_steps >= 0, f"{w}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
    check(self.decay_steps >= 0, f"{w}.decay_steps", f"must be >= 0, got {self.decay_steps}")
    check(0 <= self.final_lr_ratio <= 1, f"{w}.final_lr_ratio",
          f"must be in [0, 1], got {self.final_lr_ratio}")
    check(self.clip_norm >= 0, f"{w}.clip_norm", f"must be >= 0, got {self.clip_norm}")
    check(self.weight_decay >= 0, f"{w}.weight_decay", f"must be >= 0, got {self.weight_decay}")
    check(0 <= self.b1 < 1, f"{w}.b1", f"must be in [0, 1), got {self.b1}")
    check(0 <= self.b2 < 1, f"{w}.b2", f"must be in [0, 1), got {self.b2}")
    check(self.eps > 0, f"{w}.eps", f"must be > 0, got {self.eps}")
    one_of(self.schedule, SCHEDULES, f"{w}.schedule")


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 over `warmup_steps`, then `schedule` over `decay_steps` (0: the rest of
  a run of `total_steps` optimizer steps) down to lr * final_lr_ratio."""
  decay = cfg.decay_steps or max(total_steps - cfg.warmup_steps, 1)
  end = cfg.lr * cfg.final_lr_ratio
  if cfg.schedule == "constant":
    main = optax.constant_schedule(cfg.lr)
  elif cfg.schedule == "cosine":
    main = optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.final_lr_ratio)
  else:
    main = optax.linear_schedule(cfg.lr, end, decay)
  if cfg.warmup_steps == 0:
    return main
  warm = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
  return optax.join_schedules([warm, main], [cfg.warmup_steps])


def make_transform(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """Global-norm clipping (unless clip_norm is 0), then AdamW on `make_schedule`."""
  parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
  parts.append(optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay))
  return optax.chain(*parts)


def default_warmup(steps: int) -> int:
  """Warmup steps of a short offline trainer of `steps` steps (EAGLE-3 heads, MTP modules, LM
  pretraining): a fifth of the run, between 1 and 20, and always fewer than `steps`, so that a
  short run is not mostly warmup and a long one does not wait for its learning rate."""
  return max(min(20, max(steps // 5, 1), steps - 1), 0)


def check_trainer_fields(cfg, where: str) -> None:
  """Validate the optimizer fields of a short offline trainer's config (`steps`, `batch_size`,
  `lr`, `warmup_steps` (None: `default_warmup(steps)`), `final_lr_ratio`, `weight_decay`,
  `clip_norm`); errors name `where`.field."""
  check(cfg.steps >= 1, f"{where}.steps", f"must be >= 1, got {cfg.steps}")
  check(cfg.batch_size >= 1, f"{where}.batch_size", f"must be >= 1, got {cfg.batch_size}")
  check(cfg.lr > 0, f"{where}.lr", f"must be > 0, got {cfg.lr}")
  check(cfg.warmup_steps is None or 0 <= cfg.warmup_steps < cfg.steps, f"{where}.warmup_steps",
        f"must be None (default_warmup(steps)) or lie in [0, steps={cfg.steps}), "
        f"got {cfg.warmup_steps}")
  check(0 <= cfg.final_lr_ratio <= 1, f"{where}.final_lr_ratio",
        f"must lie in [0, 1], got {cfg.final_lr_ratio}")
  check(cfg.weight_decay >= 0, f"{where}.weight_decay", f"must be >= 0, got {cfg.weight_decay}")
  check(cfg.clip_norm > 0, f"{where}.clip_norm", f"must be > 0, got {cfg.clip_norm}")


def trainer_optim(cfg) -> OptimConfig:
  """The `OptimConfig` of a short offline trainer's config (the fields `check_trainer_fields`
  reads): warmup, then cosine decay to lr * final_lr_ratio at its last step."""
  warmup = default_warmup(cfg.steps) if cfg.warmup_steps is None else cfg.warmup_steps
  return OptimConfig(lr=cfg.lr, warmup_steps=warmup, schedule="cosine",
                     final_lr_ratio=cfg.final_lr_ratio, clip_norm=cfg.clip_norm,
                     weight_decay=cfg.weight_decay)


def trainer_transform(cfg) -> optax.GradientTransformation:
  """`make_transform` of a short offline trainer's config over its `steps`."""
  return make_transform(trainer_optim(cfg), cfg.steps)
