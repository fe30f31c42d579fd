"""Rollout sampling: the AR sampler, the lossless verifier, the rollout engine and the speculative
loop, and the `Drafter` protocol the engine calls (the drafters themselves, and the `DraftMethod`
registry, build on this package in `specjax.drafters`).

`generate` and `speculative_generate` return the same `Rollout`. Names are imported lazily
(`from specjax.sampling import generate`), so the engine's plain-Python policy modules
(`engine_config`, `buckets`, `adaptive`, `calibration`) load without jax, as the simulator needs.
"""

import importlib

_EXPORTS = {
    "generate": "ar", "EngineTuning": "calibration", "Rollout": "core", "SamplingConfig": "core",
    "Drafter": "drafter", "Sequences": "drafter", "TargetStep": "drafter",
    "STATIC": "engine_config", "EngineConfig": "engine_config", "Segment": "engine_config",
    "QueueConfig": "engine_config", "PagingConfig": "engine_config",
    "BucketConfig": "engine_config", "AdaptiveConfig": "engine_config",
    "CalibrationConfig": "engine_config", "CompileConfig": "engine_config",
    "AcceptanceCounts": "metrics", "AcceptanceMetrics": "metrics", "acceptance_metrics": "metrics",
    "count_acceptance": "metrics", "tokens_per_second": "metrics", "process_logits": "processing",
    "sample_token": "processing", "VerifyResult": "rejection", "verify": "rejection",
    "required_cache_size": "speculative", "speculative_generate": "speculative",
}


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"specjax.sampling.{_EXPORTS[name]}"), name)
  try:
    return importlib.import_module(f"specjax.sampling.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"specjax.sampling.{name}":
      raise
    raise AttributeError(f"module 'specjax.sampling' has no attribute {name!r}") from None


__all__ = sorted(_EXPORTS)
