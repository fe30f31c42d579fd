"""Every way of drafting, in one place: the `DraftMethod` registry (`methods.py`) and each drafter
with its method: n-gram and group n-gram (`ngram.py`), a draft model (`draft_model.py`), the
EAGLE-3 head (`head.py`, draft vocabulary `vocab.py`, TTT loss `ttt.py`, drafter `eagle3.py`,
community-format checkpoints `checkpoint.py`) and the native MTP module (`mtp.py`), with the
offline trainer of the learned heads (`train.py`).

Drafters plug into `specjax.sampling`'s rollout engine through its `Drafter` protocol and into the
RL train step through their method's online loss. Importing this package (or any module in it)
registers every built-in method: `none`, `ngram`, `group-ngram`, `draft-model`, `eagle3`, `mtp`,
`history` and `eagle3-history` (each prompt's earlier completions: `history.py`, its host store
`history_store.py`, and optionally any prompt's: the cross-prompt table of `corpus.py`).
"""

from specjax.drafters.methods import (DraftInit, DraftLossInputs, DraftMethod, DraftMethodBase,
                                      NoDraft, get_method, method_names, register_method)
from specjax.drafters.ngram import GroupNgramDrafter, GroupNgramMethod, NgramDrafter, NgramMethod
from specjax.drafters.draft_model import DraftModelDrafter, DraftModelMethod, truncated_copy
from specjax.drafters.checkpoint import load_head, save_head
from specjax.drafters.eagle3 import (ChainDrafter, ChainState, Eagle3Drafter, Eagle3Method,
                                     Eagle3Params, eagle3_drafter)
from specjax.drafters.history import (Eagle3HistoryMethod, HistoryDrafter, HistoryMethod,
                                      HistoryParams, HistoryState, history_lookup)
from specjax.drafters.history_store import HistoryStore, HistoryTable
from specjax.drafters.token_hash import prompt_key, prompt_keys
from specjax.drafters.corpus import CorpusStore, CorpusTable, corpus_lookup
from specjax.drafters.head import Eagle3Head, HeadConfig, init_head
from specjax.drafters.mtp import MtpDrafter, MtpMethod, mtp_drafter, mtp_loss, split_mtp
from specjax.drafters.train import (DraftTrainConfig, DraftTrainResult, Rollouts,
                                    collect_rollouts, draft_train_step, eval_ttt,
                                    train_draft_head)
from specjax.drafters.ttt import ttt_attention_mask, ttt_forward, ttt_loss, ttt_loss_module
from specjax.drafters.vocab import (VocabMaps, build_vocab_maps, build_vocab_maps_from_tokens,
                                    draft_to_target_logits, draft_to_target_probs, identity_maps,
                                    target_to_draft, token_counts)

__all__ = [
    "DraftMethod", "DraftMethodBase", "DraftInit", "DraftLossInputs", "register_method",
    "get_method", "method_names", "NoDraft",
    "NgramDrafter", "NgramMethod", "GroupNgramDrafter", "GroupNgramMethod",
    "DraftModelDrafter", "DraftModelMethod", "truncated_copy",
    "Eagle3Head", "HeadConfig", "init_head",
    "VocabMaps", "build_vocab_maps", "build_vocab_maps_from_tokens", "identity_maps",
    "draft_to_target_logits", "draft_to_target_probs", "target_to_draft", "token_counts",
    "ttt_loss", "ttt_loss_module", "ttt_forward", "ttt_attention_mask",
    "DraftTrainConfig", "DraftTrainResult", "Rollouts", "collect_rollouts", "draft_train_step",
    "eval_ttt", "train_draft_head",
    "ChainDrafter", "ChainState", "Eagle3Drafter", "Eagle3Method", "Eagle3Params", "eagle3_drafter",
    "HistoryDrafter", "HistoryMethod", "Eagle3HistoryMethod", "HistoryParams", "HistoryState",
    "HistoryStore", "HistoryTable", "history_lookup", "prompt_key", "prompt_keys",
    "CorpusStore", "CorpusTable", "corpus_lookup",
    "MtpDrafter", "MtpMethod", "mtp_drafter", "mtp_loss", "split_mtp",
    "save_head", "load_head",
]
