"""Tokenizers: a tiny character tokenizer for the embedded tasks, and a wrapper over `tokenizers`.

Both expose the same small surface: `encode`, `decode`, `vocab_size`, `pad_id`, `bos_id`,
`eos_ids`.
"""

from __future__ import annotations

import dataclasses
import json
import os

CONTROL_TOKENS = ("<pad>", "<bos>", "<eos>", "<think>", "</think>")
CHARS = "0123456789+-*/=()?:.,; \n" + "abcdefghijklmnopqrstuvwxyz" + "QA#"


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """One id per character; control tokens first. Unknown characters are an error."""

  chars: str = CHARS
  control: tuple[str, ...] = CONTROL_TOKENS

  @property
  def vocab_size(self) -> int:
    return len(self.control) + len(self.chars)

  @property
  def pad_id(self) -> int:
    return self.control.index("<pad>")

  @property
  def bos_id(self) -> int:
    return self.control.index("<bos>")

  @property
  def eos_id(self) -> int:
    return self.control.index("<eos>")

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  def token_id(self, token: str) -> int:
    if token in self.control:
      return self.control.index(token)
    return len(self.control) + self._index(token)

  def _index(self, ch: str) -> int:
    i = self.chars.find(ch)
    if i < 0 or len(ch) != 1:
      raise ValueError(f"CharTokenizer: character {ch!r} is not in the vocabulary {self.chars!r}")
    return i

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = [len(self.control) + self._index(c) for c in text]
    return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

  def decode(self, ids, *, skip_control: bool = True) -> str:
    out = []
    n = len(self.control)
    for i in ids:
      i = int(i)
      if i < n:
        if not skip_control:
          out.append(self.control[i])
      elif i < self.vocab_size:
        out.append(self.chars[i - n])
    return "".join(out)


class HFTokenizer:
  """`tokenizers.Tokenizer` from a local tokenizer.json, with EOS/pad ids from the model files."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
      raise FileNotFoundError(f"tokenizer: {file} does not exist")
    self._tok = Tokenizer.from_file(file)
    folder = os.path.dirname(file)
    self.chat_template = None
    cfg = {}
    tc = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(tc):
      with open(tc) as f:
        cfg = json.load(f)
      self.chat_template = cfg.get("chat_template")
    eos = []
    for name in ("eos_token",):
      tok = cfg.get(name)
      if isinstance(tok, dict):
        tok = tok.get("content")
      if tok is not None and self._tok.token_to_id(tok) is not None:
        eos.append(self._tok.token_to_id(tok))
    gc = os.path.join(folder, "generation_config.json")
    if os.path.exists(gc):
      with open(gc) as f:
        g = json.load(f).get("eos_token_id")
      eos += [g] if isinstance(g, int) else list(g or [])
    self.eos_ids = tuple(dict.fromkeys(eos))
    pad = cfg.get("pad_token")
    if isinstance(pad, dict):
      pad = pad.get("content")
    pad_id = self._tok.token_to_id(pad) if pad else None
    self.pad_id = pad_id if pad_id is not None else (self.eos_ids[0] if self.eos_ids else 0)
    bos = cfg.get("bos_token")
    if isinstance(bos, dict):
      bos = bos.get("content")
    self.bos_id = self._tok.token_to_id(bos) if bos else None

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  @property
  def eos_id(self) -> int:
    return self.eos_ids[0]

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if bos and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids + ([self.eos_id] if eos and self.eos_ids else [])

  def decode(self, ids, *, skip_control: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_control)
