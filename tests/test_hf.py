"""Hugging Face import: logit parity with transformers on committed tiny Qwen3/Llama checkpoints,
config mapping, tokenizer, export round trip, and the errors for broken checkpoints."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from specjax.models.hf import (config_from_hf, load_pretrained, load_tokenizer, save_pretrained,
                               tensor_specs)
from specjax.models.tokenizer import MissingChatTemplateError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN3 = os.path.join(FIXTURES, "qwen3_tiny")
LLAMA = os.path.join(FIXTURES, "llama_tiny")
TOLERANCE = 1e-4  # float32, against transformers' eager attention


@pytest.fixture(scope="module")
def models():
  return {path: load_pretrained(path) for path in (QWEN3, LLAMA)}


def _config(path):
  with open(os.path.join(path, "config.json")) as f:
    return json.load(f)


def _broken_copy(src, tmp_path, edit_config=None):
  dst = str(tmp_path / os.path.basename(src))
  shutil.copytree(src, dst)
  if edit_config is not None:
    cfg = _config(dst)
    edit_config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
      json.dump(cfg, f)
  return dst


@pytest.mark.parametrize("path", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_logits_match_transformers_reference(models, path):
  input_ids = np.load(os.path.join(path, "input_ids.npy"))
  reference = np.load(os.path.join(path, "logits.npy"))
  graphdef, state = nnx.split(models[path])
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens).logits)
  logits = np.asarray(forward(state, jnp.asarray(input_ids)))
  assert logits.shape == reference.shape == (2, input_ids.shape[1], models[path].cfg.vocab_size)
  err = float(np.abs(logits - reference).max())
  print(f"{os.path.basename(path)}: max abs logit diff vs transformers = {err:.2e}")
  assert err < TOLERANCE


def test_config_maps_qwen3_fields(models):
  cfg = models[QWEN3].cfg
  assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.mlp_hidden) == (160, 64, 3, 96)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 32)  # explicit head_dim
  assert cfg.qk_norm and cfg.tie_embeddings and models[QWEN3].lm_head is None
  assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.rms_eps == 1e-6


def test_config_maps_llama_fields_with_llama3_rope_scaling(models):
  cfg = models[LLAMA].cfg
  assert not cfg.qk_norm and not cfg.tie_embeddings and models[LLAMA].lm_head is not None
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
  rs = cfg.rope_scaling
  assert cfg.rope_theta == 1e4
  assert (rs.factor, rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position) == (
      8.0, 1.0, 4.0, 64)


def test_legacy_rope_keys_and_missing_head_dim_give_the_same_config():
  hf = _config(LLAMA)
  legacy = {k: v for k, v in hf.items() if k not in ("rope_parameters", "head_dim")}
  rope = dict(hf["rope_parameters"])
  legacy["rope_theta"] = rope.pop("rope_theta")
  rope["type"] = rope.pop("rope_type")  # the oldest spelling
  legacy["rope_scaling"] = rope
  assert config_from_hf(legacy) == config_from_hf(LLAMA)


def test_config_overrides_replace_fields():
  cfg = config_from_hf(QWEN3, aux_layers=(0, 1, 2), dtype="bfloat16")
  assert cfg.aux_layers == (0, 1, 2) and cfg.dtype == "bfloat16" and cfg.param_dtype == "float32"


def test_tokenizer_encodes_the_reference_prompt():
  for path in (QWEN3, LLAMA):
    tok = load_tokenizer(path, require_chat_template=False)
    with open(os.path.join(path, "input_text.txt")) as f:
      text = f.read()
    ids = tok.encode(text)
    assert ids == np.load(os.path.join(path, "input_ids.npy"))[0, :len(ids)].tolist()
    assert (tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, (2,))
    # WordLevel decoding joins tokens with spaces; control tokens are skipped.
    assert tok.decode(tok.encode(text, bos=True, eos=True)) == text.replace("12", "1 2").replace(
        "19", "1 9")
    assert tok.vocab_size == config_from_hf(path).vocab_size


def test_bfloat16_load_stores_parameters_in_bfloat16():
  model = load_pretrained(LLAMA, dtype="bfloat16")
  dtypes = {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)} and model.cfg.compute_dtype == jnp.bfloat16


def test_device_put_receives_every_parameter_with_its_logical_axes():
  seen = {}

  def put(x, axes):
    seen[axes] = seen.get(axes, 0) + 1
    assert x.ndim == len(axes)
    return jax.device_put(x)

  model = load_pretrained(LLAMA, device_put=put)
  assert sum(seen.values()) == len(tensor_specs(model.cfg))
  assert seen[("vocab", "embed")] == 1 and seen[("embed", "vocab")] == 1
  assert seen[("embed", "heads", "head_dim")] == model.cfg.num_layers


def test_mtp_override_adds_a_fresh_mtp_module(models):
  with pytest.warns(UserWarning, match="ships no MTP weights"):
    model = load_pretrained(QWEN3, mtp=True)
  assert model.cfg.mtp and model.mtp is not None
  np.testing.assert_array_equal(model.embed.get_value(), models[QWEN3].embed.get_value())


@pytest.mark.parametrize("path", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_save_pretrained_round_trips_exactly(models, path, tmp_path):
  written = save_pretrained(models[path], str(tmp_path), max_shard_bytes=100_000,
                            tokenizer_from=path)
  assert "model.safetensors.index.json" in written and "tokenizer.json" in written
  reloaded = load_pretrained(str(tmp_path))
  assert reloaded.cfg == models[path].cfg
  before = nnx.state(models[path], nnx.Param)
  after = nnx.state(reloaded, nnx.Param)
  jax.tree.map(np.testing.assert_array_equal, before, after)


# -- errors ---------------------------------------------------------------------------------------

def test_unknown_architecture_names_config_json_and_the_architecture(tmp_path):
  def mistral(cfg):
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
  path = _broken_copy(QWEN3, tmp_path, mistral)
  with pytest.raises(ValueError, match=r"config\.json.*MistralForCausalLM"):
    load_pretrained(path)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "yarn"),
])
def test_unsupported_config_features_are_rejected(tmp_path, edit, field):
  path = _broken_copy(LLAMA, tmp_path, edit)
  with pytest.raises(ValueError, match=rf"config\.json.*{field}"):
    config_from_hf(path)


def test_missing_tensor_names_the_tensor_and_the_shard_files(tmp_path):
  path = _broken_copy(QWEN3, tmp_path)
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  del tensors["model.layers.1.self_attn.k_norm.weight"]
  save_file(tensors, file)
  with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.*"
                                       r"model\.safetensors"):
    load_pretrained(path)


def test_missing_tensor_in_the_shard_index_names_the_tensor_and_the_shards(tmp_path):
  path = _broken_copy(LLAMA, tmp_path)
  index = os.path.join(path, "model.safetensors.index.json")
  with open(index) as f:
    meta = json.load(f)
  del meta["weight_map"]["lm_head.weight"]
  with open(index, "w") as f:
    json.dump(meta, f)
  with pytest.raises(ValueError, match=r"lm_head\.weight.*model-00001-of-00002\.safetensors"):
    load_pretrained(path)


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
  path = _broken_copy(QWEN3, tmp_path, lambda c: c.update(intermediate_size=100))
  with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight.*"
                                       r"\((96, 64|64, 96)\).*\((100, 64|64, 100)\)"):
    load_pretrained(path)


def test_unexpected_tensors_are_rejected(tmp_path):
  path = _broken_copy(LLAMA, tmp_path, lambda c: c.update(num_hidden_layers=1))
  with pytest.raises(ValueError, match=r"model\.layers\.1\."):
    load_pretrained(path)


# -- chat templates as transformers writes them ---------------------------------------------------

def _tokenizer_dir(tmp_path, files):
  dst = tmp_path / "tok"
  dst.mkdir()
  shutil.copy(os.path.join(LLAMA, "tokenizer.json"), dst / "tokenizer.json")
  for name, text in files.items():
    (dst / name).write_text(text)
  return str(dst)


def test_chat_template_is_read_from_chat_template_jinja_as_transformers_5_saves_it():
  tok = load_tokenizer(QWEN3)
  assert tok.chat_template.startswith("{% for m in messages %}<|im_start|>")
  assert tok.chat_template_source.endswith("chat_template.jinja")


@pytest.mark.parametrize("files,want", [
    ({"chat_template.jinja": "J{{ 1 }}", "tokenizer_config.json": '{"chat_template": "C"}'}, "J"),
    ({"chat_template.json": '{"chat_template": "S{{ 1 }}"}'}, "S"),
    ({"tokenizer_config.json": '{"chat_template": "C{{ 1 }}"}'}, "C"),
    ({"tokenizer_config.json": '{"chat_template": [{"name": "tool", "template": "T"}, '
                               '{"name": "default", "template": "D{{ 1 }}"}]}'}, "D"),
], ids=["jinja-first", "json", "tokenizer-config", "named-list"])
def test_chat_template_sources_in_transformers_order(tmp_path, files, want):
  assert load_tokenizer(_tokenizer_dir(tmp_path, files)).chat_template[0] == want


def test_a_missing_chat_template_is_an_error_naming_the_directory(tmp_path):
  path = _tokenizer_dir(tmp_path, {"tokenizer_config.json": '{"eos_token": "<eos>"}'})
  with pytest.raises(MissingChatTemplateError, match=f"{path}: no chat template.*chat_template"):
    load_tokenizer(path)


def test_an_explicit_chat_template_choice_replaces_the_directorys(tmp_path):
  path = _tokenizer_dir(tmp_path, {})
  none = load_tokenizer(path, chat_template="none")
  assert none.chat_template is None and none.chat_template_source == "none"
  assert load_tokenizer(path, chat_template="{{ messages }}").chat_template == "{{ messages }}"
  (tmp_path / "t.jinja").write_text("F{{ x }}")
  assert load_tokenizer(path, chat_template=str(tmp_path / "t.jinja")).chat_template == "F{{ x }}"
  with pytest.raises(ValueError, match="not 'none', not an existing file"):
    load_tokenizer(path, chat_template="plain words")


# -- native MTP weights ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_model():
  with pytest.warns(UserWarning, match="ships no MTP weights.*freshly initialised"):
    return load_pretrained(QWEN3, mtp=True, seed=3)


def _mtp_logits(model, ids):
  ids = jnp.asarray(ids)
  return np.asarray(model.mtp_forward(model(ids).hidden, ids).logits)


@pytest.mark.parametrize("layout", ["deepseek", "qwen3_next", "mimo"])
def test_mtp_weights_round_trip_in_each_checkpoint_layout(mtp_model, tmp_path, layout):
  save_pretrained(mtp_model, str(tmp_path), tokenizer_from=QWEN3, mtp_layout=layout)
  names = set(load_file(str(tmp_path / "model.safetensors")))
  first = {"deepseek": "model.layers.3.eh_proj.weight", "qwen3_next": "mtp.fc.weight",
           "mimo": "model.mtp_layers.0.input_proj.weight"}[layout]
  assert first in names
  back = load_pretrained(str(tmp_path), mtp=True)
  ids = np.load(os.path.join(QWEN3, "input_ids.npy"))
  np.testing.assert_array_equal(_mtp_logits(back, ids), _mtp_logits(mtp_model, ids))


def test_mtp_layouts_follow_each_models_conventions(mtp_model, tmp_path):
  """Written by hand from the DeepSeek-V3 layout: Qwen3-Next renames (mtp.fc on concat(embed,
  hidden)); MiMo renames and puts the hidden state first in input_proj's input."""
  save_pretrained(mtp_model, str(tmp_path / "ds"), mtp_layout="deepseek")
  tensors = load_file(str(tmp_path / "ds" / "model.safetensors"))
  ds = {k[len("model.layers.3."):]: tensors.pop(k) for k in list(tensors)
        if k.startswith("model.layers.3.")}
  pieces = {"enorm.weight": ("mtp.pre_fc_norm_embedding.weight",
                             "model.mtp_layers.0.token_layernorm.weight"),
            "hnorm.weight": ("mtp.pre_fc_norm_hidden.weight",
                             "model.mtp_layers.0.hidden_layernorm.weight"),
            "eh_proj.weight": ("mtp.fc.weight", "model.mtp_layers.0.input_proj.weight"),
            "shared_head.norm.weight": ("mtp.norm.weight",
                                        "model.mtp_layers.0.final_layernorm.weight")}
  ids = np.load(os.path.join(QWEN3, "input_ids.npy"))
  want = _mtp_logits(mtp_model, ids)
  for which, layer_prefix in ((0, "mtp.layers.0."), (1, "model.mtp_layers.0.")):
    out = dict(tensors)
    for name, value in ds.items():
      if name in pieces:
        if which == 1 and name == "eh_proj.weight":  # [d, 2d] columns: (hidden, embed)
          value = np.concatenate([value[:, 64:], value[:, :64]], axis=1)
        out[pieces[name][which]] = value
      else:
        out[layer_prefix + name] = value
    dst = tmp_path / f"hand{which}"
    shutil.copytree(tmp_path / "ds", dst)
    save_file(out, str(dst / "model.safetensors"))
    np.testing.assert_array_equal(_mtp_logits(load_pretrained(str(dst), mtp=True), ids), want)


def test_mtp_weights_are_left_unread_without_mtp_and_extras_are_reported(mtp_model, tmp_path):
  save_pretrained(mtp_model, str(tmp_path / "m"), mtp_layout="deepseek")
  assert load_pretrained(str(tmp_path / "m")).mtp is None
  tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
  tensors["model.layers.4.enorm.weight"] = np.ones(64, np.float32)  # a second MTP layer
  tensors["model.layers.4.eh_proj.weight"] = np.ones((64, 128), np.float32)
  tensors["model.layers.3.embed_tokens.weight"] = np.zeros((160, 64), np.float32)
  save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
  with pytest.warns(UserWarning) as record:
    load_pretrained(str(tmp_path / "m"), mtp=True)
  messages = " | ".join(str(w.message) for w in record)
  assert "only the first MTP layer" in messages and "embed_tokens.weight differs" in messages
  tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = np.ones((4, 4), np.float32)
  save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
  with pytest.raises(ValueError, match=r"no place in specjax's MTP module.*experts"):
    load_pretrained(str(tmp_path / "m"), mtp=True)
