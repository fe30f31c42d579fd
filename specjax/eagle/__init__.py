"""EAGLE-3 draft head (reduced vocabulary, TTT loss, offline training, drafter) and the MTP drafter.

Plugs into `specjax.sampling` as a `Drafter` and into the RL train step as a loss; importing this
package registers the `eagle3` and `mtp` draft methods.
"""

from specjax.eagle.checkpoint import load_head, save_head
from specjax.eagle.drafter import (ChainDrafter, ChainState, Eagle3Drafter, Eagle3Method,
                                   Eagle3Params, eagle3_drafter)
from specjax.eagle.head import Eagle3Head, HeadConfig, init_head
from specjax.eagle.mtp import (MtpDrafter, MtpMethod, masked_cross_entropy, mtp_drafter, mtp_loss,
                               split_mtp)
from specjax.eagle.train import (DraftTrainConfig, DraftTrainResult, Rollouts, collect_rollouts,
                                 draft_train_step, eval_ttt, train_draft_head)
from specjax.eagle.ttt import ttt_attention_mask, ttt_forward, ttt_loss, ttt_loss_module
from specjax.eagle.vocab import (VocabMaps, build_vocab_maps, build_vocab_maps_from_tokens,
                                 draft_to_target_logits, draft_to_target_probs, identity_maps,
                                 target_to_draft, token_counts)

__all__ = [
    "Eagle3Head", "HeadConfig", "init_head",
    "VocabMaps", "build_vocab_maps", "build_vocab_maps_from_tokens", "identity_maps",
    "draft_to_target_logits", "draft_to_target_probs", "target_to_draft", "token_counts",
    "ttt_loss", "ttt_loss_module", "ttt_forward", "ttt_attention_mask",
    "DraftTrainConfig", "DraftTrainResult", "Rollouts", "collect_rollouts", "draft_train_step",
    "eval_ttt", "train_draft_head",
    "ChainDrafter", "ChainState", "Eagle3Drafter", "Eagle3Method", "Eagle3Params", "eagle3_drafter",
    "MtpDrafter", "MtpMethod", "mtp_drafter", "mtp_loss", "masked_cross_entropy", "split_mtp",
    "save_head", "load_head",
]
