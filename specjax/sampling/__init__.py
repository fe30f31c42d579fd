"""Rollout sampling: the AR sampler, the lossless verifier, the rollout engine and the speculative
loop, the `Drafter` protocol, the `DraftMethod` registry and the model-free and draft-model
drafters (the learned heads, EAGLE-3 and MTP, build on this package in `specjax.eagle`).

`generate` and `speculative_generate` return the same `Rollout`. Names are imported lazily
(`from specjax.sampling import generate`), so the engine's plain-Python policy modules
(`engine_config`, `buckets`, `adaptive`, `calibration`) load without jax, as the simulator needs.
"""

import importlib

_EXPORTS = {
    "generate": "ar", "EngineTuning": "calibration", "Rollout": "core", "SamplingConfig": "core",
    "DraftModelDrafter": "draft_model", "DraftModelMethod": "draft_model",
    "truncated_copy": "draft_model", "Drafter": "drafter", "Sequences": "drafter",
    "TargetStep": "drafter", "STATIC": "engine_config", "EngineConfig": "engine_config",
    "Segment": "engine_config", "AcceptanceCounts": "metrics", "AcceptanceMetrics": "metrics",
    "acceptance_metrics": "metrics", "count_acceptance": "metrics", "tokens_per_second": "metrics",
    "DraftInit": "methods", "DraftLossInputs": "methods", "DraftMethod": "methods",
    "DraftMethodBase": "methods", "NoDraft": "methods", "get_method": "methods",
    "method_names": "methods", "register_method": "methods", "GroupNgramDrafter": "ngram",
    "GroupNgramMethod": "ngram", "NgramDrafter": "ngram", "NgramMethod": "ngram",
    "process_logits": "processing", "sample_token": "processing", "VerifyResult": "rejection",
    "verify": "rejection", "required_cache_size": "speculative",
    "speculative_generate": "speculative",
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
