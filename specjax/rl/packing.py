"""Sequence packing for the train step: a rollout batch's sequences laid end to end in rows of a
fixed width, several per row, then cut into micro-batches of a fixed number of rows.

Long-tailed completions waste most of a padded [B, prompt + max_new] batch; packed, the train step
computes on about as many positions as there are tokens, and one compiled program of shape
[rows, width] serves every batch (the number of micro-batches varies, not their shape).
"""

from __future__ import annotations

import numpy as np

def sequence_extents(loss_mask: np.ndarray) -> np.ndarray:
  """int[B]: positions each row uses (prompt + completion = one past its last loss position); 0
  for a row without completion tokens (it adds nothing to the loss and is left out)."""
  m = np.asarray(loss_mask) > 0
  last = m.shape[1] - np.argmax(m[:, ::-1], axis=1)
  return np.where(m.any(axis=1), last, 0)


def attention_work(loss_mask: np.ndarray) -> tuple[float, float]:
  """(positions, causal (query, key) pairs) of the rows a train step computes its loss on: each
  row's prompt and completion up to its last loss position (`sequence_extents`), no padding."""
  e = sequence_extents(loss_mask).astype(np.float64)
  return float(e.sum()), float((e * (e + 1) / 2).sum())


def first_fit_rows(extents: np.ndarray, width: int) -> list[list[int]]:
  """Row indices packed into rows of `width` positions, first fit in decreasing order of extent
  (rows of extent 0 are left out). Each packed row lists its sequences in the order laid down."""
  order = sorted((i for i in range(len(extents)) if extents[i] > 0),
                 key=lambda i: (-int(extents[i]), i))
  rows: list[list[int]] = []
  free: list[int] = []
  for i in order:
    n = int(extents[i])
    if n > width:
      raise ValueError(f"packing: a sequence of {n} positions (prompt + completion) does not fit "
                       f"a packed row of {width}; raise TrainConfig.pack_width or set it "
                       f"to 0 (the batch's own width)")
    for r, f in enumerate(free):
      if f >= n:
        rows[r].append(i)
        free[r] -= n
        break
    else:
      rows.append([i])
      free.append(width - n)
  return rows


def pack(fields: dict[str, np.ndarray | None], width: int, rows_per_micro: int) -> list[dict]:
  """Micro-batches of packed rows from a host batch `fields` (TrainBatch's fields as numpy:
  [B, S] per position, `advantages` [B]). Each micro-batch has `rows_per_micro` rows of `width`
  positions and the keys of `fields` (None stays None; `advantages` per position) plus
  `positions` (each sequence's own, from 0), `segment_ids` (-1 on padding) and `seq_lengths`
  (each position's sequence's completion tokens). Empty rows pad the last micro-batch."""
  mask = np.asarray(fields["loss_mask"])
  extents = sequence_extents(mask)
  rows = first_fit_rows(extents, width)
  n_rows = max(1, -(-len(rows) // rows_per_micro)) * rows_per_micro
  src_row = np.zeros((n_rows, width), np.int64)
  src_col = np.zeros((n_rows, width), np.int64)
  real = np.zeros((n_rows, width), bool)
  segment = np.full((n_rows, width), -1, np.int32)
  for r, seqs in enumerate(rows):
    at = 0
    for s, i in enumerate(seqs):
      n = int(extents[i])
      src_row[r, at:at + n] = i
      src_col[r, at:at + n] = np.arange(n)
      real[r, at:at + n] = True
      segment[r, at:at + n] = s
      at += n
  packed: dict[str, np.ndarray | None] = {}
  for name, x in fields.items():
    if x is None:
      packed[name] = None
      continue
    x = np.asarray(x)
    per_pos = x[:, None].repeat(mask.shape[1], axis=1) if name == "advantages" else x
    packed[name] = np.where(real, per_pos[src_row, src_col], np.zeros((), per_pos.dtype))
  packed["positions"] = src_col.astype(np.int32)  # each sequence's own positions, from 0
  packed["segment_ids"] = segment
  packed["seq_lengths"] = np.where(real, mask.sum(axis=1)[src_row], 0).astype(np.float32)
  return [{k: (None if v is None else v[i:i + rows_per_micro]) for k, v in packed.items()}
          for i in range(0, n_rows, rows_per_micro)]
