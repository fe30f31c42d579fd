"""The static shape of a draft tree that one verify forward scores.

A chain of K drafts, and at each of its first D depths i = 1..D (`depth`; 0: all K),
`width - 1` alternatives to the chain's draft there: leaves whose parent is the chain's node at
depth i - 1. Node 0 is the root (the row's last committed token), nodes 1..K the chain, then the
alternatives depth by depth. A chain reaches depth i less often the deeper i lies, so the first
depths' alternatives buy most of a tree's extra acceptance for fewer scored positions. The
forward writes node t's keys and values at cache slot `lengths + t` and gives it the position
`lengths + depth(t)`; node t attends to the committed cache and to its ancestors (itself
included). A `width` of 1 is the plain chain.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class DraftTree:
  draft_len: int  # K: depth of the chain
  width: int  # candidates per depth: the chain's draft and width - 1 alternatives
  depth: int = 0  # the first depths that carry alternatives; 0: every depth

  def __post_init__(self):
    if self.draft_len < 1:
      raise ValueError(f"DraftTree.draft_len: must be >= 1, got {self.draft_len}")
    if self.width < 1:
      raise ValueError(f"DraftTree.width: must be >= 1, got {self.width}")
    if self.depth < 0:
      raise ValueError(f"DraftTree.depth: must be >= 0 (0: every depth), got {self.depth}")

  @property
  def alt_depths(self) -> int:
    """D: the depths 1..D that carry alternatives (at most K)."""
    return self.draft_len if self.depth == 0 else min(self.depth, self.draft_len)

  @property
  def nodes(self) -> int:
    """Positions a verify forward scores: the root, K chain drafts, D * (width - 1)
    alternatives."""
    return 1 + self.draft_len + self.alt_depths * (self.width - 1)

  def alternative(self, depth: int, j: int) -> int:
    """Node index of alternative j (0-based) at `depth` (1-based)."""
    return 1 + self.draft_len + (depth - 1) * (self.width - 1) + j

  @functools.cached_property
  def depths(self) -> np.ndarray:
    """int32[nodes]: each node's depth (its position offset from the root)."""
    d = np.zeros(self.nodes, np.int32)
    d[1:self.draft_len + 1] = np.arange(1, self.draft_len + 1)
    for depth in range(1, self.alt_depths + 1):
      for j in range(self.width - 1):
        d[self.alternative(depth, j)] = depth
    return d

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """bool[nodes, nodes]: [t, s] True when node s is node t or one of its ancestors."""
    a = np.zeros((self.nodes, self.nodes), bool)
    for t in range(self.draft_len + 1):  # the chain: every earlier chain node
      a[t, :t + 1] = True
    for depth in range(1, self.alt_depths + 1):
      for j in range(self.width - 1):
        t = self.alternative(depth, j)
        a[t, :depth] = True  # the chain up to its parent (depth - 1)
        a[t, t] = True
    return a
