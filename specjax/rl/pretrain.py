"""A small SFT / pretraining helper that builds base policies for the RL runs (e.g. a tiny model
that half-knows arithmetic, which GRPO then improves).

Thin layer over `specjax.eagle.mtp.train_lm` (LM loss, + MTP when the model has that module).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specjax.models.decoder import Decoder


def encode_sft(tokenizer, examples: Sequence[str | tuple[str, str]],
               width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32[M, W], loss mask bool[M, W]) of BOS + text + EOS rows, right-padded.

  A plain string is learned whole; a (prompt, completion) pair learns only the completion and
  its EOS. The mask marks tokens to predict (mask[b, j]: learn token j)."""
  rows, masks = [], []
  bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
  for ex in examples:
    prompt, completion = ("", ex) if isinstance(ex, str) else ex
    p = bos + tokenizer.encode(prompt)
    c = tokenizer.encode(completion, eos=True)
    rows.append(p + c)
    masks.append([False] * len(p) + [True] * len(c))
  w = width or max(len(r) for r in rows)
  if any(len(r) > w for r in rows):
    raise ValueError(f"encode_sft: an example has {max(len(r) for r in rows)} tokens > width {w}")
  tokens = np.full((len(rows), w), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(rows), w), bool)
  for i, (r, m) in enumerate(zip(rows, masks)):
    tokens[i, :len(r)] = r
    mask[i, :len(m)] = m
  return tokens, mask


def pretrain_lm(model: Decoder, examples: Sequence[str | tuple[str, str]], tokenizer, *,
                steps: int = 300, batch_size: int = 64, lr: float = 3e-3, warmup_steps: int = 10,
                weight_decay: float = 0.0, seed: int = 0, mtp_weight: float = 0.3,
                progress: bool = False) -> tuple[Decoder, list[dict[str, float]]]:
  """Supervised fine-tuning of `model` on texts or (prompt, completion) pairs; returns the trained
  decoder (a new module) and the per-step loss history."""
  from specjax.eagle.mtp import LmTrainConfig, train_lm

  tokens, mask = encode_sft(tokenizer, examples)
  cfg = LmTrainConfig(steps=steps, batch_size=batch_size, learning_rate=lr,
                      warmup_steps=min(warmup_steps, steps - 1), weight_decay=weight_decay,
                      mtp_weight=mtp_weight, seed=seed)
  return train_lm(model, tokens, mask, cfg, progress=progress)
