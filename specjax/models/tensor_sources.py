"""Where a checkpoint's tensors are read from, by Hugging Face name: the safetensors shards of a
directory (`SafetensorsDir`) or a GGUF file (`GGUFTensors`, through `gguf_import.GGUFCheckpoint`).
Both give the same three things to `hf.load_pretrained`: the names, their shapes (headers only,
before any weight is read) and the values."""

from __future__ import annotations

import json
import os

from safetensors import safe_open

from specjax.errors import UserError

INDEX_FILE = "model.safetensors.index.json"


def tensor_files(path: str) -> dict[str, str]:
  """Tensor name -> shard file: from model.safetensors.index.json, else from every *.safetensors."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
      raise UserError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    for file in sorted(set(weight_map.values())):
      if not os.path.exists(os.path.join(path, file)):
        raise UserError(f"{index} names the shard {file}, which does not exist in {path}")
    return {name: os.path.join(path, file) for name, file in weight_map.items()}
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise UserError(f"Hugging Face import: no *.safetensors file in {path}")
  names = {}
  for file in files:
    try:
      with safe_open(os.path.join(path, file), framework="np") as f:
        names.update({name: os.path.join(path, file) for name in f.keys()})
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
      raise UserError(f"{os.path.join(path, file)}: damaged safetensors file "
                      f"({type(e).__name__}: {e})") from None
  return names


class SafetensorsDir:
  """A Hugging Face directory's tensors: names, shapes (headers only) and values by shard."""

  def __init__(self, path: str):
    self.path, self.files = path, tensor_files(path)

  def where(self) -> str:
    return str(sorted({os.path.basename(f) for f in self.files.values()}))

  def _by_file(self, names) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for name in names:
      by_file.setdefault(self.files[name], []).append(name)
    return by_file

  def shapes(self, names) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for file, file_names in self._by_file(names).items():
      with safe_open(file, framework="np") as f:
        for name in file_names:
          out[name] = (tuple(f.get_slice(name).get_shape()), file)
    return out

  def read(self, names):
    for file, file_names in self._by_file(names).items():
      with safe_open(file, framework="np") as f:
        for name in file_names:
          yield name, f.get_tensor(name)


class GGUFTensors:
  """A GGUF file's tensors as a Hugging Face checkpoint's (`gguf_import.GGUFCheckpoint`)."""

  def __init__(self, ckpt):
    self.ckpt, self.files = ckpt, ckpt.names

  def where(self) -> str:
    return self.ckpt.path

  def shapes(self, names) -> dict[str, tuple[tuple[int, ...], str]]:
    return {name: (self.ckpt.names[name], self.ckpt.path) for name in names}

  def read(self, names):
    for name in names:
      yield name, self.ckpt.tensor(name)
