"""Host-side page allocation for paged KV memory (numpy only, no jax).

`PageAllocator` owns the free list of a pool of `num_pages` pages of `page_size` tokens and the
pages of every row: which pages a row holds, in position order, and how many rows reference each
page. The device side (`specjax.models.paged`) reads the resulting page table; the allocator never
touches KV values, it only says which page copies the device must make.

Sharing: the samples of a GRPO group start from one prompt, so the prompt's full pages are
shared by reference count (prefilled once, read by every sample) and freed when the last row
holding them is released. A shared page is never written again: a row writes only at positions
>= its length, and shared pages lie wholly below that. The partly filled last prompt page is the
exception that would be written by every sample, so each sample gets a private copy of it.

Preemption takes the most recently admitted rows first (the latest arrivals, which have the
least work to redo), as vLLM's scheduler does.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import numpy as np

NO_PAGE = -1  # page-table sentinel; the same value as specjax.models.paged.NO_PAGE
PADDING_ROW = -1  # a page-table slot with no row (as EngineState.row_ids marks padding)


class PageAllocator:
  def __init__(self, num_pages: int, page_size: int, max_pages_per_row: int | None = None):
    if not isinstance(num_pages, numbers.Integral) or num_pages < 1:
      raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    if not isinstance(page_size, numbers.Integral) or page_size < 1:
      raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if max_pages_per_row is not None and (not isinstance(max_pages_per_row, numbers.Integral)
                                          or max_pages_per_row < 1):
      raise ValueError(f"max_pages_per_row must be a positive int or None, got "
                       f"{max_pages_per_row!r}")
    self.num_pages = int(num_pages)
    self.page_size = int(page_size)
    self.max_pages_per_row = self.num_pages if max_pages_per_row is None else int(max_pages_per_row)
    # a stack; popping from the end hands out low page ids first (easier to read when debugging)
    self._free = list(range(self.num_pages - 1, -1, -1))
    self._refs = np.zeros(self.num_pages, np.int32)
    self._pages: dict[int, list[int]] = {}  # row -> its pages in position order
    self._tokens: dict[int, int] = {}  # row -> tokens its pages must hold
    self._admitted: dict[int, int] = {}  # row -> admission number (recency for preemption)
    self._clock = 0

  # -- counters -----------------------------------------------------------------------------------

  @property
  def free_pages(self) -> int:
    return len(self._free)

  @property
  def pages_in_use(self) -> int:
    return self.num_pages - len(self._free)

  @property
  def rows(self) -> tuple[int, ...]:
    """Admitted rows, oldest admission first."""
    return tuple(sorted(self._admitted, key=self._admitted.__getitem__))

  def __contains__(self, row) -> bool:
    return row in self._pages

  def row_pages(self, row: int) -> tuple[int, ...]:
    self._check_known(row, "row")
    return tuple(self._pages[row])

  def row_tokens(self, row: int) -> int:
    self._check_known(row, "row")
    return self._tokens[row]

  def refcount(self, page: int) -> int:
    """How many rows hold `page` (0: free)."""
    if not isinstance(page, numbers.Integral) or not 0 <= page < self.num_pages:
      raise ValueError(f"page must be an int in [0, {self.num_pages}), got {page!r}")
    return int(self._refs[page])

  def pages_for(self, num_tokens: int) -> int:
    return -(-int(num_tokens) // self.page_size)

  # -- admission and growth -----------------------------------------------------------------------

  def admit(self, row: int, num_tokens: int) -> bool:
    """Take pages for `num_tokens` tokens of a new row. False (nothing taken) when too few pages
    are free; ValueError when the row is already admitted or could never fit."""
    self._check_row(row, "row")
    if row in self._pages:
      raise ValueError(f"row {row} is already admitted; release it first")
    need = self._check_tokens(num_tokens, "num_tokens")
    if need > len(self._free):
      return False
    self._pages[row] = self._take(need)
    self._tokens[row] = int(num_tokens)
    self._stamp(row)
    return True

  def grow(self, row: int, new_length: int) -> bool:
    """Take the pages row needs to hold `new_length` tokens. False (nothing taken) when too few
    pages are free. A length the row's pages already hold takes nothing."""
    self._check_known(row, "row")
    need = self._check_tokens(new_length, "new_length") - len(self._pages[row])
    if need > len(self._free):
      return False
    if need > 0:
      self._pages[row].extend(self._take(need))
    self._tokens[row] = max(self._tokens[row], int(new_length))
    return True

  def release(self, row: int) -> None:
    """Return the row's pages; shared pages go back to the free list with their last holder."""
    self._check_known(row, "row")
    for page in reversed(self._pages.pop(row)):
      self._refs[page] -= 1
      if self._refs[page] == 0:
        self._free.append(page)
    del self._tokens[row], self._admitted[row]

  def share_prefix(self, src_row: int, dst_rows: Iterable[int],
                   prefix_len: int) -> list[tuple[int, int]] | None:
    """Admit `dst_rows` (new rows) with the first `prefix_len` tokens of `src_row`: its full
    pages are shared (reference counted), and a partly filled last page is copied, one private
    page per destination. Returns the (src_page, dst_page) pairs the device must copy (empty when
    prefix_len is a multiple of page_size), or None, with nothing changed, when too few pages are
    free for the copies."""
    self._check_known(src_row, "src_row")
    dst_rows = list(dst_rows)
    for row in dst_rows:
      self._check_row(row, "dst_rows")
      if row in self._pages:
        raise ValueError(f"dst_rows: row {row} is already admitted")
    if len(set(dst_rows)) != len(dst_rows):
      raise ValueError(f"dst_rows has repeated rows: {dst_rows}")
    if not isinstance(prefix_len, numbers.Integral) or prefix_len < 0:
      raise ValueError(f"prefix_len must be a non-negative int, got {prefix_len!r}")
    if prefix_len > self._tokens[src_row]:
      raise ValueError(f"prefix_len={prefix_len} exceeds the {self._tokens[src_row]} tokens of "
                       f"src_row {src_row}")
    full, partial = divmod(int(prefix_len), self.page_size)
    if partial and len(dst_rows) > len(self._free):
      return None
    shared = self._pages[src_row][:full]
    copies = []
    for row in dst_rows:
      pages = list(shared)
      self._refs[shared] += 1
      if partial:
        [page] = self._take(1)
        copies.append((self._pages[src_row][full], page))
        pages.append(page)
      self._pages[row] = pages
      self._tokens[row] = int(prefix_len)
      self._stamp(row)
    return copies

  # -- preemption and the page table --------------------------------------------------------------

  def preempt_candidates(self, need_pages: int, keep: Iterable[int] = ()) -> list[int] | None:
    """The most recently admitted rows (newest first, none of `keep`) whose release would leave
    at least `need_pages` pages free, counting pages already free: [] when enough are free, None
    when releasing every row outside `keep` would not be enough. Releases nothing."""
    if not isinstance(need_pages, numbers.Integral) or need_pages < 0:
      raise ValueError(f"need_pages must be a non-negative int, got {need_pages!r}")
    if need_pages > self.num_pages:
      raise ValueError(f"need_pages={need_pages} exceeds the whole pool ({self.num_pages} pages)")
    keep = set(keep)
    refs = self._refs.copy()
    free, chosen = len(self._free), []
    for row in reversed(self.rows):
      if free >= need_pages:
        break
      if row in keep:
        continue
      chosen.append(row)
      pages = np.asarray(self._pages[row], np.int64)
      np.subtract.at(refs, pages, 1)
      free += int(np.sum(refs[np.unique(pages)] == 0))  # pages this release drops to zero
    return chosen if free >= need_pages else None

  def page_table(self, rows: Sequence[int], max_pages: int) -> np.ndarray:
    """int32[len(rows), max_pages]: each row's pages in position order, NO_PAGE after them and
    for PADDING_ROW slots."""
    if not isinstance(max_pages, numbers.Integral) or max_pages < 1:
      raise ValueError(f"max_pages must be a positive int, got {max_pages!r}")
    table = np.full((len(rows), int(max_pages)), NO_PAGE, np.int32)
    for i, row in enumerate(rows):
      if row == PADDING_ROW:
        continue
      self._check_known(row, "rows")
      pages = self._pages[row]
      if len(pages) > max_pages:
        raise ValueError(f"max_pages={max_pages} is too small for row {row}, which holds "
                         f"{len(pages)} pages")
      table[i, :len(pages)] = pages
    return table

  # -- internals ----------------------------------------------------------------------------------

  def _take(self, n: int) -> list[int]:
    pages = [self._free.pop() for _ in range(n)]
    self._refs[pages] += 1
    return pages

  def _stamp(self, row: int) -> None:
    self._admitted[row] = self._clock
    self._clock += 1

  def _check_row(self, row, name: str) -> None:
    if not isinstance(row, numbers.Integral) or isinstance(row, bool) or row < 0:
      raise ValueError(f"{name}: a row is a non-negative int, got {row!r}")

  def _check_known(self, row, name: str) -> None:
    self._check_row(row, name)
    if row not in self._pages:
      raise ValueError(f"{name}: row {row} is not admitted")

  def _check_tokens(self, num_tokens, name: str) -> int:
    """Pages for `num_tokens` tokens, checked against what a row can ever hold."""
    if not isinstance(num_tokens, numbers.Integral) or num_tokens < 0:
      raise ValueError(f"{name} must be a non-negative int, got {num_tokens!r}")
    need = self.pages_for(num_tokens)
    limit = min(self.num_pages, self.max_pages_per_row)
    if need > limit:
      what = "the whole pool" if limit == self.num_pages else "a row's page table"
      raise ValueError(f"{name}={num_tokens} needs {need} pages of {self.page_size} tokens, more "
                       f"than {what} ({limit} pages): the row can never fit")
    return need
