"""Export of a policy as a Hugging Face directory: logits survive the round trip, the source's
config (architecture, dtype) and tokenizer files are kept, shards are indexed, writes are atomic."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from specjax.models.export import export_hf
from specjax.models.hf import load_pretrained, load_tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN3 = os.path.join(FIXTURES, "qwen3_tiny")
LLAMA = os.path.join(FIXTURES, "llama_tiny")


@pytest.fixture(scope="module")
def models():
  return {path: load_pretrained(path) for path in (QWEN3, LLAMA)}


def _logits(model, path):
  return np.asarray(model(jnp.asarray(np.load(os.path.join(path, "input_ids.npy")))).logits)


@pytest.mark.parametrize("path", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_export_then_reload_gives_the_same_logits(models, path, tmp_path):
  out = export_hf(models[path], str(tmp_path / "export"), source_dir=path, max_shard_bytes=100_000)
  files = sorted(os.listdir(out))
  assert "model.safetensors.index.json" in files and "tokenizer.json" in files
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    shards = set(json.load(f)["weight_map"].values())
  assert len(shards) > 1 and shards <= set(files)
  np.testing.assert_array_equal(_logits(load_pretrained(out), path), _logits(models[path], path))


def test_export_keeps_the_source_config_and_copies_the_tokenizer_with_its_template(models,
                                                                                   tmp_path):
  out = export_hf(models[QWEN3], str(tmp_path / "export"), source_dir=QWEN3)
  with open(os.path.join(QWEN3, "config.json")) as f:
    source = json.load(f)
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  assert exported == source  # architecture, rope_parameters, layer_types, dtype, ... all kept
  assert os.path.exists(os.path.join(out, "chat_template.jinja"))
  assert load_tokenizer(out).chat_template == load_tokenizer(QWEN3).chat_template


def test_export_writes_the_requested_dtype_and_records_it(models, tmp_path):
  out = export_hf(models[LLAMA], str(tmp_path / "bf16"), source_dir=LLAMA, dtype="bfloat16")
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  assert config["architectures"] == ["LlamaForCausalLM"]
  assert {config.get(k) for k in ("torch_dtype", "dtype")} - {None} == {"bfloat16"}
  shard = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))[0]
  with safe_open(os.path.join(out, shard), framework="np") as f:
    assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
  again = load_pretrained(out, dtype="bfloat16")
  assert again.embed.get_value().dtype == jnp.bfloat16


def test_export_without_a_source_writes_specjaxs_own_config(models, tmp_path):
  out = export_hf(models[LLAMA], str(tmp_path / "plain"))
  assert not os.path.exists(os.path.join(out, "tokenizer.json"))
  np.testing.assert_array_equal(_logits(load_pretrained(out), LLAMA), _logits(models[LLAMA], LLAMA))


def test_export_refuses_a_non_empty_directory_unless_told_and_leaves_no_temporaries(models,
                                                                                    tmp_path):
  target = tmp_path / "out"
  target.mkdir()
  (target / "keep.txt").write_text("x")
  with pytest.raises(FileExistsError, match="exists and is not empty"):
    export_hf(models[LLAMA], str(target), source_dir=LLAMA)
  assert os.listdir(target) == ["keep.txt"]
  export_hf(models[LLAMA], str(target), source_dir=LLAMA, overwrite=True)
  assert "keep.txt" not in os.listdir(target) and "config.json" in os.listdir(target)
  assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary or old directories left


def test_a_failed_export_leaves_nothing_behind(models, tmp_path):
  with pytest.raises(ValueError, match="dtype must be one of"):
    export_hf(models[LLAMA], str(tmp_path / "bad"), dtype="int8")
  with pytest.raises(ValueError, match=r"qwen3_tiny/config.json has vocab_size=160, the policy 128"):
    export_hf(models[LLAMA], str(tmp_path / "bad"), source_dir=QWEN3)
  assert os.listdir(tmp_path) == []


def test_an_export_interrupted_mid_write_leaves_the_old_directory_untouched(models, tmp_path,
                                                                            monkeypatch):
  import specjax.models.export as export

  out = export_hf(models[LLAMA], str(tmp_path / "out"), source_dir=LLAMA)
  before = sorted(os.listdir(out))

  def crash(model, path, **kw):
    open(os.path.join(path, "model.safetensors"), "w").close()
    raise OSError("disk full")

  monkeypatch.setattr(export, "save_pretrained", crash)
  with pytest.raises(OSError, match="disk full"):
    export_hf(models[LLAMA], out, source_dir=LLAMA, overwrite=True)
  assert sorted(os.listdir(out)) == before and os.listdir(tmp_path) == ["out"]


def test_export_carries_the_mtp_module_in_the_sources_layout(tmp_path):
  with pytest.warns(UserWarning, match="ships no MTP weights"):
    model = load_pretrained(QWEN3, mtp=True)
  first = export_hf(model, str(tmp_path / "a"), source_dir=QWEN3, mtp_layout="mimo")
  again = export_hf(load_pretrained(first, mtp=True), str(tmp_path / "b"), source_dir=first)
  with safe_open(os.path.join(again, "model.safetensors"), framework="np") as f:
    assert "model.mtp_layers.0.input_proj.weight" in set(f.keys())
  with pytest.warns(UserWarning, match="ships MTP weights.*not exported"):
    export_hf(load_pretrained(first), str(tmp_path / "c"), source_dir=first)
