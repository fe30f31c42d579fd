"""Tokenizers: a tiny character tokenizer for the embedded tasks, and a wrapper over `tokenizers`.

Both expose the same small surface: `encode`, `decode`, `vocab_size`, `pad_id`, `bos_id`,
`eos_ids`. `HFTokenizer` also carries the model's chat template, found where transformers writes it.
"""

from __future__ import annotations

import dataclasses
import json
import os

from specjax.errors import UserError

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


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
NO_TEMPLATE = "none"


def _template_from_json(value, file: str) -> str:
  """A chat template as stored in JSON: a string, or a list of {name, template} (the "default")."""
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(named.get("default"), str):
      return named["default"]
  raise UserError(f"{file}: field 'chat_template' must be a string or a list of "
                  f"{{name, template}} with a 'default' entry")


def read_chat_template(folder: str) -> tuple[str | None, str | None]:
  """(template, file it came from) from a tokenizer directory, or (None, None). Looks where
  transformers writes it, in its order of precedence: chat_template.jinja (recent transformers
  save it there, version 5 only there), chat_template.json, then tokenizer_config.json's field."""
  jinja = os.path.join(folder, "chat_template.jinja")
  if os.path.exists(jinja):
    with open(jinja, encoding="utf-8") as f:
      return f.read(), jinja
  for name in CHAT_TEMPLATE_FILES[1:]:
    file = os.path.join(folder, name)
    if os.path.exists(file):
      value = read_json(file).get("chat_template")
      if value is not None:
        return _template_from_json(value, file), file
  return None, None


def resolve_chat_template(folder: str, choice: str | None) -> tuple[str | None, str | None]:
  """(template, source) for a tokenizer directory and the caller's `choice`: None reads the
  directory (template None, source None when it has none); "none" chooses no template on purpose;
  a path to a .jinja/.json file reads that file; any other string is the jinja template itself."""
  if choice is None:
    return read_chat_template(folder)
  if choice == NO_TEMPLATE:
    return None, NO_TEMPLATE
  if os.path.isfile(choice):
    with open(choice, encoding="utf-8") as f:
      text = f.read()
    if choice.endswith(".json"):
      return _template_from_json(read_json(choice).get("chat_template"), choice), choice
    return text, choice
  if "{{" in choice or "{%" in choice:
    return choice, "argument"
  raise UserError(f"chat template choice {choice!r}: not 'none', not an existing file and not a "
                  "jinja template (no '{{' or '{%')")


def read_json(file: str) -> dict:
  """A checkpoint's JSON object file (config.json, tokenizer.json, ...); a damaged one is an
  error naming it."""
  try:
    with open(file, encoding="utf-8") as f:
      value = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
    raise UserError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(value, dict):
    raise UserError(f"{file}: expected a JSON object, got {type(value).__name__}")
  return value


class MissingChatTemplateError(UserError):
  """The tokenizer directory has no chat template and the caller chose none explicitly."""


class HFTokenizer:
  """`tokenizers.Tokenizer` from a local tokenizer.json, with EOS/pad ids from the model files.

  `chat_template` is the caller's choice (see `resolve_chat_template`); the resolved template is
  `self.chat_template` (None when there is none) and where it came from `self.chat_template_source`
  (a file, "argument", "none" for an explicit no-template choice, None when the directory has
  none). `require_chat_template()` turns a missing template into an error naming the directory.
  """

  def __init__(self, path: str, chat_template: str | None = None):
    """`path`: a tokenizer directory (or its tokenizer.json), or a GGUF file (its vocabulary,
    special token ids and chat template, `specjax.models.gguf_import`)."""
    from tokenizers import Tokenizer

    from specjax.models.gguf_import import GGUFCheckpoint, gguf_path

    if gguf_path(path):
      gguf = GGUFCheckpoint(path)
      self._tok = Tokenizer.from_str(gguf.tokenizer_json())
      self.path = path
      if chat_template is None:
        template = gguf.chat_template
        self.chat_template, self.chat_template_source = template, path if template else None
      else:
        self.chat_template, self.chat_template_source = resolve_chat_template(path, chat_template)
      ids = gguf.special_ids()
      self.eos_ids = (ids["eos"],) if "eos" in ids else ()
      self.pad_id = ids.get("padding", self.eos_ids[0] if self.eos_ids else 0)
      self.bos_id = ids.get("bos")
      return
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise UserError(f"tokenizer: {file} does not exist")
    try:
      self._tok = Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own error types
      reason = (str(e).splitlines() or [type(e).__name__])[0]
      raise UserError(f"{file}: not a readable tokenizer ({reason})") from None
    folder = os.path.dirname(file)
    self.path = folder
    self.chat_template, self.chat_template_source = resolve_chat_template(folder, chat_template)
    cfg = {}
    tc = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(tc):
      cfg = read_json(tc)
    eos = []
    for name in ("eos_token",):
      tok = cfg.get(name)
      if isinstance(tok, dict):
        tok = tok.get("content")
      if tok is not None and self._tok.token_to_id(tok) is not None:
        eos.append(self._tok.token_to_id(tok))
    gc = os.path.join(folder, "generation_config.json")
    if os.path.exists(gc):
      g = read_json(gc).get("eos_token_id")
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

  def require_chat_template(self) -> str | None:
    """The template; raises MissingChatTemplateError when the directory has none and no explicit
    choice was made (never a silent fallback)."""
    if self.chat_template is None and self.chat_template_source is None:
      raise MissingChatTemplateError(
          f"{self.path}: no chat template (looked in {', '.join(CHAT_TEMPLATE_FILES)}); choose one "
          f"explicitly: chat_template='{NO_TEMPLATE}' (plain 'Role: content' prompts), a "
          ".jinja file, or a jinja string")
    return self.chat_template

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
