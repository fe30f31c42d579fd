"""Rollout sampling: the AR sampler, the lossless verifier, the speculative loop and its drafters.

`generate` and `speculative_generate` return the same `Rollout`; drafters implement `Drafter`, and
each way of drafting is a registered `DraftMethod` (`get_method(name)`).
"""

from specjax.sampling.ar import generate
from specjax.sampling.core import Rollout, SamplingConfig
from specjax.sampling.draft_model import DraftModelDrafter, DraftModelMethod, truncated_copy
from specjax.sampling.drafter import Drafter, Sequences, TargetStep
from specjax.sampling.metrics import (AcceptanceCounts, AcceptanceMetrics, acceptance_metrics,
                                      count_acceptance, tokens_per_second)
from specjax.sampling.methods import (DraftInit, DraftLossInputs, DraftMethod, DraftMethodBase,
                                      NoDraft, get_method, method_names, register_method)
from specjax.sampling.ngram import GroupNgramDrafter, GroupNgramMethod, NgramDrafter, NgramMethod
from specjax.sampling.processing import process_logits, sample_token
from specjax.sampling.rejection import VerifyResult, verify
from specjax.sampling.speculative import required_cache_size, speculative_generate

__all__ = [
    "Rollout", "SamplingConfig", "generate",
    "required_cache_size", "speculative_generate",
    "AcceptanceCounts", "AcceptanceMetrics", "acceptance_metrics", "count_acceptance",
    "tokens_per_second",
    "Drafter", "Sequences", "TargetStep",
    "NgramDrafter", "GroupNgramDrafter", "DraftModelDrafter", "truncated_copy",
    "DraftMethod", "DraftMethodBase", "DraftInit", "DraftLossInputs", "register_method",
    "get_method", "method_names", "NoDraft", "NgramMethod", "GroupNgramMethod", "DraftModelMethod",
    "VerifyResult", "verify", "process_logits", "sample_token",
]
