"""Import of a GGUF file (llama.cpp's checkpoint format): config, weights, tokenizer, chat template.

A GGUF file of a Llama-architecture model is read as the Hugging Face checkpoint it was made from:
its metadata as config.json's fields, its tensors under Hugging Face names and in Hugging Face
layout (llama.cpp stores q and k projections with their rotary halves interleaved; they are put
back), its vocabulary and merges as a `tokenizers` BPE, its chat template as the tokenizer's.
`load_pretrained` and `load_tokenizer` (`specjax.models.hf`) take a `.gguf` path as they take a
directory. The `gguf` package (llama.cpp's own reader, `pip install gguf`) reads the file and
dequantizes its tensors to float32: **the dequantized weights are the model from then on** (it
computes, trains and exports in float32 or bfloat16; nothing is requantized), so an imported
model equals llama.cpp's quantized one only as closely as float32 holds the dequantized values.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from specjax.errors import UserError

# GGUF architectures read here -> the Hugging Face architecture they come from
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# tensor types read here: full precision and what the `gguf` package dequantizes
FLOAT_TYPES = ("F32", "F16", "BF16")
CONTROL_TOKEN = 3  # llama.cpp's token type of special (control) tokens
USER_DEFINED_TOKEN = 4
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
               "use_regex": True}
# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the `tokenizers` pre-tokenizer of the
# Hugging Face tokenizer they stand for: GPT-2's split, and SmolLM's (digits one by one first)
PRE_TOKENIZERS = {
    "default": _BYTE_LEVEL, "gpt-2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
}


def gguf_path(path: str) -> bool:
  """True for a path that names a GGUF file (by its suffix; it need not exist yet)."""
  return str(path).lower().endswith(".gguf")


def _reader(path: str):
  try:
    import gguf
  except ImportError:
    raise UserError(f"{path}: reading a GGUF file needs the `gguf` package "
                    f"(pip install gguf)") from None
  if not os.path.isfile(path):
    raise UserError(f"{path}: no such GGUF file")
  try:
    return gguf, gguf.GGUFReader(path)
  except Exception as e:  # noqa: BLE001 - the reader raises plain ValueErrors and struct errors
    raise UserError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's q/k permutation: per head, its rows are stored as interleaved (even, odd)
  rotary pairs; Hugging Face keeps the two rotary halves one after the other."""
  rows = w.shape[0]
  return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
  """A GGUF file read as a Hugging Face checkpoint: `config` (config.json's fields), `names`
  (tensor name -> Hugging Face shape), `tensor(name)` (float32, Hugging Face layout),
  `tokenizer_json()` and `chat_template`. Unsupported architectures, tensor types and tensors
  are refused when it is opened, each with the file and what it holds."""

  def __init__(self, path: str):
    self.path = path
    self._gguf, self.reader = _reader(path)
    self.meta = {k: f for k, f in self.reader.fields.items()}
    arch = self._field("general.architecture")
    if arch not in ARCHITECTURES:
      raise UserError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                      f"{sorted(ARCHITECTURES)})")
    self.arch = arch
    supported = set(FLOAT_TYPES) | {t.name for t in self._quantized_types()}
    self._tensors = {t.name: t for t in self.reader.tensors}
    for t in self.reader.tensors:
      if t.tensor_type.name not in supported:
        raise UserError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which the "
                        f"gguf package does not dequantize (supported: {sorted(supported)})")
    self.config = self._config()
    self.names = self._names()

  def _quantized_types(self):
    """The quantized types this `gguf` version dequantizes (its table of them; a version without
    that table: every type it knows, and `tensor` names a type it then cannot read)."""
    traits = getattr(self._gguf.quants, "_type_traits", None)
    return traits.keys() if traits is not None else self._gguf.GGML_QUANT_SIZES.keys()

  def _field(self, key: str, default: Any = None) -> Any:
    field = self.meta.get(key)
    if field is None:
      if default is None:
        raise UserError(f"{self.path}: GGUF metadata {key!r} missing")
      return default
    return field.contents()

  def _config(self) -> dict:
    a = self.arch
    heads = int(self._field(f"{a}.attention.head_count"))
    hidden = int(self._field(f"{a}.embedding_length"))
    scaling = self._field(f"{a}.rope.scaling.type", "none")
    if scaling != "none":
      raise UserError(f"{self.path}: RoPE scaling {scaling!r} in a GGUF file is not supported")
    vocab = len(self.meta["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in self.meta \
        else int(self._field(f"{a}.vocab_size"))
    key_length = int(self._field(f"{a}.attention.key_length", hidden // heads))
    return {
        "architectures": [ARCHITECTURES[a]], "model_type": a, "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": int(self._field(f"{a}.feed_forward_length")),
        "num_hidden_layers": int(self._field(f"{a}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(self._field(f"{a}.attention.head_count_kv", heads)),
        "head_dim": key_length,
        "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(self._field(f"{a}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in self._tensors,
        "bos_token_id": int(self._field("tokenizer.ggml.bos_token_id", -1)),
        "eos_token_id": int(self._field("tokenizer.ggml.eos_token_id", -1)),
        "hidden_act": "silu", "torch_dtype": "float32",
    }

  def _names(self) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor; a tensor with no Hugging Face place is an
    error."""
    names = {}
    for name, t in self._tensors.items():
      hf = _hf_name(name)
      if hf is None:
        raise UserError(f"{self.path}: tensor {name!r} has no place in a {self.arch} decoder")
      names[hf] = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGML lists dims inner first
    return names

  def tensor(self, hf_name: str) -> np.ndarray:
    """The tensor of `hf_name`, dequantized to float32, in Hugging Face layout."""
    name = _gguf_name(hf_name)
    t = self._tensors[name]
    if t.tensor_type.name in FLOAT_TYPES:
      w = np.asarray(t.data).astype(np.float32)
    else:
      try:
        w = self._gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
      except NotImplementedError:
        raise UserError(f"{self.path}: tensor {name!r} has type {t.tensor_type.name}, which this "
                        f"version of the gguf package does not dequantize") from None
    w = w.reshape(self.names[hf_name])
    if name.endswith("attn_q.weight"):
      w = _unpermute(w, self.config["num_attention_heads"])
    elif name.endswith("attn_k.weight"):
      w = _unpermute(w, self.config["num_key_value_heads"])
    return w

  @property
  def chat_template(self) -> str | None:
    field = self.meta.get("tokenizer.chat_template")
    return None if field is None else field.contents()

  def special_ids(self) -> dict[str, int]:
    """bos / eos / pad / unk token ids the file names."""
    out = {}
    for role in ("bos", "eos", "padding", "unknown"):
      field = self.meta.get(f"tokenizer.ggml.{role}_token_id")
      if field is not None:
        out[role] = int(field.contents())
    return out

  def tokenizer_json(self) -> str:
    """The file's vocabulary as a `tokenizers` tokenizer.json: a byte-level BPE for llama.cpp's
    "gpt2" tokenizer model (the Llama-3, Qwen and SmolLM families), with its control tokens as
    special tokens."""
    model = self._field("tokenizer.ggml.model")
    if model != "gpt2":
      raise UserError(f"{self.path}: GGUF tokenizer model {model!r} is not supported (supported: "
                      f"'gpt2', a byte-level BPE)")
    tokens = self._field("tokenizer.ggml.tokens")
    merges = self._field("tokenizer.ggml.merges")
    types = self._field("tokenizer.ggml.token_type", [1] * len(tokens))
    specials = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": kind == CONTROL_TOKEN}
                for i, (tok, kind) in enumerate(zip(tokens, types))
                if kind in (CONTROL_TOKEN, USER_DEFINED_TOKEN)]
    pre = self._field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
      raise UserError(f"{self.path}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                      f"{sorted(PRE_TOKENIZERS)})")
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials,
        "normalizer": None, "pre_tokenizer": PRE_TOKENIZERS[pre], "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    })


  def write_tokenizer_files(self, folder: str) -> None:
    """tokenizer.json, tokenizer_config.json (special tokens, chat template) and
    generation_config.json in `folder`: the tokenizer of a Hugging Face export of this model."""
    tokens = self._field("tokenizer.ggml.tokens")
    ids = self.special_ids()
    names = {"bos": "bos_token", "eos": "eos_token", "padding": "pad_token", "unknown": "unk_token"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": self.config["max_position_embeddings"],
              **{names[role]: tokens[i] for role, i in ids.items()}}
    if self.chat_template:
      config["chat_template"] = self.chat_template
    generation = {f"{role}_token_id": ids[role] for role in ("bos", "eos") if role in ids}
    files = {"tokenizer.json": self.tokenizer_json(), "tokenizer_config.json": json.dumps(config),
             "generation_config.json": json.dumps(generation)}
    for name, text in files.items():
      with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        f.write(text)


_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def _hf_name(name: str) -> str | None:
  if name in _TOP:
    return _TOP[name]
  parts = name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER and parts[3] == "weight":
    return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.weight"
  return None


def _gguf_name(hf_name: str) -> str:
  for k, v in _TOP.items():
    if v == hf_name:
      return k
  parts = hf_name.split(".")  # model.layers.{i}.{module}.{proj}.weight
  module = ".".join(parts[3:-1])
  kind = next(k for k, v in _LAYER.items() if v == module)
  return f"blk.{parts[2]}.{kind}.weight"
