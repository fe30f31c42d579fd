"""The engine's bucket and window policy: which static batch sizes (buckets) compaction may
gather live rows into, which attention window a step reads, and whether rows come in GRPO groups
of identical prompts. Plain Python and numpy, so the simulator follows the same policy."""

from __future__ import annotations

import math

import numpy as np

NO_LIMIT = 2 ** 30  # an iteration budget that never binds


def data_parallel_size(mesh) -> int:
  if mesh is None:
    return 1
  return math.prod(mesh.shape[a] for a in ("data", "fsdp") if a in mesh.shape)


def bucket_sizes(batch: int, dp: int = 1, min_bucket: int = 1, max_buckets: int = 64) -> list[int]:
  """Descending buckets: the batch, then the powers of two below it that are multiples of `dp`
  and >= min_bucket, at most `max_buckets` in all."""
  if batch % dp:
    raise ValueError(f"batch of {batch} rows is not divisible by the data-parallel size {dp} "
                     f"(mesh axes data x fsdp): every device must hold whole rows")
  out, b = [batch], 1 << (batch - 1).bit_length()
  while b > 1:
    b //= 2
    if b < batch and b % dp == 0 and b >= max(min_bucket, dp) and len(out) < max_buckets:
      out.append(b)
  return out


def compaction(homes, buckets: list[int], slots: int, dp: int = 1,
               by_replica: bool = False) -> tuple[int, np.ndarray, np.ndarray]:
  """(bucket, idx, pad): the smallest bucket that holds the live rows whose full-state slots are
  `homes`, the slot each of its rows comes from, and which rows are padding (a copy of a live
  row, finished at once). `by_replica` (paged KV on a mesh): each data-parallel replica's rows
  stay on it, so the bucket must hold the most rows any replica has on each replica (the slots
  [r * slots / dp, (r + 1) * slots / dp) are replica r's, as are a bucket's rows
  [r * bucket / dp, (r + 1) * bucket / dp))."""
  homes = np.asarray(homes, np.int64)
  if not by_replica or dp == 1:
    size = min(b for b in buckets if b >= len(homes))
    idx = np.concatenate([homes, np.full(size - len(homes), homes[0])])
    return size, idx.astype(np.int32), np.arange(size) >= len(homes)
  per_slot = slots // dp
  replica = homes // per_slot
  most = int(np.bincount(replica, minlength=dp).max())
  size = min(b for b in buckets if b // dp >= most)
  per = size // dp
  idx = np.repeat(np.arange(dp) * per_slot, per)  # padding: a slot of the row's own replica
  pad = np.ones(size, bool)
  for r in range(dp):
    mine = homes[replica == r]
    idx[r * per:r * per + len(mine)] = mine
    pad[r * per:r * per + len(mine)] = False
  return size, idx.astype(np.int32), pad


def prompt_group(prompts, prompt_lengths, dp: int = 1) -> int:
  """The largest g such that the rows come in consecutive blocks of g identical prompts (GRPO
  groups) and the distinct prompts still divide over the data-parallel size `dp`; 1 when no
  block repeats or the prompts are not all on this host (a multi-process array)."""
  if not all(getattr(x, "is_fully_addressable", True) for x in (prompts, prompt_lengths)):
    return 1
  p, lengths = np.asarray(prompts), np.asarray(prompt_lengths)
  batch = p.shape[0]
  for g in range(batch, 1, -1):
    if batch % g or (batch // g) % dp:
      continue
    blocks, lens = p.reshape(batch // g, g, -1), lengths.reshape(batch // g, g)
    if (blocks == blocks[:, :1]).all() and (lens == lens[:, :1]).all():
      return g
  return 1


def window_for(longest: int, draft_len: int, block: int, cache_size: int) -> int:
  """Smallest `block * 2^j` that holds a step's writes (positions < longest + K + 1); 0 (the
  whole cache) when that reaches the cache size or windows are off. Doubling keeps the number of
  compiled windows logarithmic in the cache size."""
  if not block:
    return 0
  w = block
  while w < longest + draft_len + 1:
    w *= 2
  return 0 if w >= cache_size else w


def queue_slots(batch: int, max_rows: int, group: int, dp: int,
                refill_fraction: float) -> tuple[int, int, int]:
  """(slots, refill, prefill): rows stepped at once, free slots that make a segment return and
  are then filled (`refill_fraction` of the slots, rounded up to the data-parallel size), and
  rows prefilled at once (whole prompt groups spread evenly over the data-parallel size: at least
  `refill`, `group * dp` at a time). A group's samples that find no free slot yet wait
  prefilled for the next ones. No queue (every count the batch) when `max_rows` is 0 or holds
  the batch."""
  unit = group * dp
  if not max_rows or max_rows >= batch:
    return batch, batch, batch
  slots = max(max_rows // unit, 1) * unit
  if slots >= batch:
    return batch, batch, batch
  wanted = int(math.ceil(slots * refill_fraction))
  prefill = min(-(-wanted // unit) * unit, slots)
  refill = min(-(-wanted // dp) * dp, slots)
  return slots, refill, prefill
