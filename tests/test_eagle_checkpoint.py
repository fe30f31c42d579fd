"""EAGLE-3 heads in the community layout (LlamaForCausalLMEagle3: midlayer.*, fc, norm, lm_head,
d2t offsets, t2d mask): a committed head written with plain torch naming loads, matches a torch
reference forward and drafts losslessly for its policy; save/load round trips; clear errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from specjax.drafters.checkpoint import (eagle3_aux_layers, load_draft_head, load_eagle3_hf,
                                      save_eagle3_hf, save_head)
from specjax.drafters.eagle3 import eagle3_drafter
from specjax.drafters.head import init_head
from specjax.drafters.ttt import ttt_forward
from specjax.drafters.vocab import build_vocab_maps
from specjax.models.hf import load_pretrained
from specjax.sampling import SamplingConfig, generate, speculative_generate

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN3 = os.path.join(FIXTURES, "qwen3_tiny")
HEAD = os.path.join(FIXTURES, "qwen3_tiny_eagle3")


@pytest.fixture(scope="module")
def policy():
  return load_pretrained(QWEN3)


@pytest.fixture(scope="module")
def community(policy):
  return load_eagle3_hf(HEAD, policy.cfg)


def _leaves(head):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(head))]


def test_committed_community_head_matches_the_torch_reference_forward(policy, community):
  head, maps = community
  ref = np.load(os.path.join(HEAD, "reference.npz"))
  ids = jnp.asarray(ref["input_ids"])
  # the reference feeds token t+1 at position t (zero past the end): ttt step 0 does the same
  logits = ttt_forward(head, policy.embed[...], policy(ids).aux_hidden, ids, 1)[0]
  np.testing.assert_allclose(np.asarray(logits), ref["draft_logits"], atol=2e-4, rtol=1e-4)
  # the head's own layer shape (2 heads, 1 kv head, MLP 64) comes from its config.json
  t = head.cfg.target
  assert (t.num_heads, t.num_kv_heads, t.head_dim, t.mlp_hidden, t.qk_norm) == (2, 1, 32, 64, False)


def test_community_d2t_offsets_become_target_ids_and_t2d_the_mask(community):
  _, maps = community
  raw = load_file(os.path.join(HEAD, "model.safetensors"))
  want = np.concatenate([np.arange(34), np.arange(60, 74)])
  np.testing.assert_array_equal(np.asarray(maps.d2t), want)
  np.testing.assert_array_equal(np.asarray(maps.d2t), np.arange(48) + raw["d2t"])
  assert np.asarray(maps.t2d).sum() == 48 and np.asarray(maps.t2d)[want].all()


def test_committed_community_head_drafts_losslessly_for_its_policy(policy, community):
  head, maps = community
  prompts = jnp.asarray(np.load(os.path.join(QWEN3, "input_ids.npy"))[:, :8])
  lengths = jnp.asarray([8, 5], jnp.int32)
  greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
  drafter, params = eagle3_drafter(head, policy.embed[...], maps, draft_len=3)
  ar = generate(policy, prompts, lengths, jax.random.key(0), greedy)
  spec = speculative_generate(policy, drafter, params, prompts, lengths, jax.random.key(1), greedy)
  np.testing.assert_array_equal(spec.tokens, ar.tokens)
  np.testing.assert_array_equal(spec.lengths, ar.lengths)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama-layer", "qwen3-layer"])
def test_save_then_load_round_trips_params_and_maps(policy, tmp_path, qk_norm):
  head = init_head(policy.cfg, 40, seed=1, qk_norm=qk_norm)
  maps = build_vocab_maps(np.random.default_rng(0).random(160), 160, 40)
  if qk_norm:
    with pytest.warns(UserWarning, match="q/k norm"):
      path = save_eagle3_hf(str(tmp_path / "h"), head, maps)
  else:
    path = save_eagle3_hf(str(tmp_path / "h"), head, maps)
  back, back_maps = load_eagle3_hf(path, policy.cfg)
  for a, b in zip(_leaves(head), _leaves(back), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(back_maps.d2t, maps.d2t)
  np.testing.assert_array_equal(back_maps.t2d, maps.t2d)


def test_saved_head_uses_the_community_names_offsets_and_config(policy, tmp_path):
  head = init_head(policy.cfg.replace(qk_norm=False), 40, seed=1)
  maps = build_vocab_maps(np.arange(160.0), 160, 40)  # the 40 highest ids: offsets 120
  path = save_eagle3_hf(str(tmp_path / "h"), head, maps, embed_table=policy.embed[...],
                        dtype="bfloat16")
  tensors = load_file(os.path.join(path, "model.safetensors"))
  mid = {f"midlayer.{n}.weight" for n in (
      "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
      "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
      "mlp.down_proj")}
  assert set(tensors) == mid | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                                "embed_tokens.weight"}
  assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * 32, 2 * 64)
  assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["lm_head.weight"].shape == (40, 64)
  np.testing.assert_array_equal(tensors["d2t"], np.full(40, 120))
  assert tensors["t2d"].dtype == np.bool_ and tensors["t2d"].sum() == 40
  assert tensors["fc.weight"].dtype == jnp.bfloat16
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  assert config["architectures"] == ["LlamaForCausalLMEagle3"]
  assert (config["draft_vocab_size"], config["vocab_size"], config["num_hidden_layers"]) == \
      (40, 160, 1)
  assert "eagle_aux_hidden_state_layer_ids" not in config["eagle_config"]  # the default layers


def test_non_default_aux_layers_are_written_as_layer_outputs_and_read_back(policy, tmp_path):
  cfg = policy.cfg.replace(qk_norm=False, aux_layers=(1, 2, 2))
  path = save_eagle3_hf(str(tmp_path / "h"), init_head(cfg, 20), build_vocab_maps(
      np.ones(160), 160, 20))
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
  assert eagle3_aux_layers(path, 3) == (1, 2, 2)
  with pytest.raises(ValueError, match=r"load the policy with aux_layers=\(1, 2, 2\)"):
    load_eagle3_hf(path, policy.cfg)
  head, _ = load_eagle3_hf(path, policy.cfg.replace(aux_layers=(1, 2, 2)))
  assert head.cfg.target.aux_layer_ids == (1, 2, 2)


def test_load_draft_head_reads_the_community_and_the_orbax_layouts(policy, community, tmp_path):
  head, maps = load_draft_head(HEAD, policy.cfg)
  assert head.cfg.draft_vocab == 48
  ours = init_head(policy.cfg, 30, seed=2)
  ours_maps = build_vocab_maps(np.ones(160), 160, 30)
  save_head(str(tmp_path / "orbax"), ours, ours_maps)
  back, _ = load_draft_head(str(tmp_path / "orbax"), policy.cfg)
  for a, b in zip(_leaves(ours), _leaves(back), strict=True):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="does not name an EAGLE-3 architecture"):
    load_draft_head(QWEN3, policy.cfg)


def _broken(tmp_path, edit_config=None, edit_tensors=None):
  dst = str(tmp_path / "head")
  shutil.copytree(HEAD, dst)
  if edit_config:
    with open(os.path.join(dst, "config.json")) as f:
      cfg = json.load(f)
    edit_config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
      json.dump(cfg, f)
  if edit_tensors:
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
  return dst


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(hidden_size=32), r"config\.json: hidden_size=32, the policy has 64"),
    (lambda c: c.update(vocab_size=100), r"config\.json: vocab_size=100"),
    (lambda c: c.update(num_hidden_layers=2), r"config\.json: num_hidden_layers=2"),
    (lambda c: c.update(norm_before_residual=True), r"norm_before_residual"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), r"not an EAGLE-3 head"),
])
def test_bad_configs_name_the_file_and_the_field(policy, tmp_path, edit, message):
  with pytest.raises(ValueError, match=message):
    load_eagle3_hf(_broken(tmp_path, edit_config=edit), policy.cfg)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("midlayer.hidden_norm.weight"), r"tensor 'midlayer\.hidden_norm\.weight' not"),
    (lambda t: t.update(d2t=t["d2t"] + 200), r"d2t \(offsets\) gives target ids outside"),
    (lambda t: t.update(t2d=np.ones(160, bool)), r"t2d marks 160 target ids, not the 48"),
    (lambda t: t.update({"fc.weight": t["fc.weight"][:, :64]}),
     r"'fc\.weight' has shape \(64, 64\), expected \(64, 192\)"),
    (lambda t: t.update(extra=np.zeros(2, np.float32)), r"no place in the EAGLE-3 head: \['extra'\]"),
])
def test_bad_tensors_name_the_tensor(policy, tmp_path, edit, message):
  with pytest.raises(ValueError, match=message):
    load_eagle3_hf(_broken(tmp_path, edit_tensors=edit), policy.cfg)


def test_a_shipped_embedding_that_differs_from_the_policys_is_reported(policy, tmp_path):
  path = _broken(tmp_path, edit_tensors=lambda t: t.update(
      {"embed_tokens.weight": np.zeros((160, 64), np.float32)}))
  with pytest.warns(UserWarning, match="embed_tokens.weight differs"):
    load_eagle3_hf(path, policy.cfg, policy_embed=policy.embed[...])
