"""The decoder's contract: shapes, causality, ragged KV-cache equivalence, GQA, tied heads, MTP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import CharTokenizer, Decoder, ModelConfig
from specjax.models.layers import attend, causal_mask

V, B, T, S = 48, 3, 12, 20
CFG = ModelConfig(vocab_size=V, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_hidden=64, tie_embeddings=False, mtp=True)


@pytest.fixture(scope="module")
def model():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward(model):
  graphdef, params = nnx.split(model)

  @jax.jit
  def run(params, tokens, cache=None):
    return nnx.merge(graphdef, params)(tokens, cache=cache)

  return lambda tokens, cache=None: run(params, tokens, cache)


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (B, T), 0, V)


def test_forward_returns_logits_hidden_and_three_aux_streams(forward, tokens):
  out = forward(tokens)
  assert out.logits.shape == (B, T, V) and out.logits.dtype == jnp.float32
  assert out.hidden.shape == (B, T, CFG.hidden_size)
  assert out.aux_hidden.shape == (B, T, 3 * CFG.hidden_size)
  assert CFG.aux_layer_ids == (2, 2, 1)


def test_aux_hidden_is_the_residual_stream_entering_the_named_layers(model, tokens):
  m = Decoder(CFG.replace(aux_layers=(0,)), rngs=nnx.Rngs(0))
  out = m(tokens)
  np.testing.assert_allclose(out.aux_hidden, m.embed_tokens(tokens), atol=0)


def test_changing_a_future_token_never_changes_earlier_logits(forward, tokens):
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % V)
  a, b = forward(tokens).logits, forward(changed).logits
  np.testing.assert_array_equal(a[:, :7], b[:, :7])
  assert np.abs(a[:, 7:] - b[:, 7:]).max() > 1e-6


def test_ragged_prefill_then_mixed_appends_equal_the_full_forward(model, forward, tokens):
  full = forward(tokens).logits
  prompt_lengths = jnp.array([5, 2, 6])
  cache = model.init_cache(B, S)
  out = forward(tokens[:, :8], cache)  # padded prefill; entries past each length are garbage
  for r in range(B):
    n = int(prompt_lengths[r])
    assert np.abs(out.logits[r, :n] - full[r, :n]).max() < 1e-4
  cache = out.cache.with_lengths(prompt_lengths)
  pos = np.asarray(prompt_lengths)
  # write 3 tokens per row each step, commit a different number per row (1, 2 or 3)
  for commit in ([1, 3, 2], [3, 1, 1], [2, 2, 1]):  # stays inside T
    chunk = jnp.stack([tokens[r, pos[r]:pos[r] + 3] for r in range(B)])
    out = forward(chunk, cache)
    for r in range(B):
      np.testing.assert_allclose(out.logits[r], full[r, pos[r]:pos[r] + 3], atol=1e-4)
    cache = out.cache.advance(jnp.array(commit))
    pos = pos + np.array(commit)
  np.testing.assert_array_equal(cache.lengths, pos)


def test_single_token_decode_matches_full_forward(model, forward, tokens):
  full = forward(tokens).logits
  cache = model.init_cache(B, S)
  for t in range(T):
    out = forward(tokens[:, t:t + 1], cache)
    np.testing.assert_allclose(out.logits[:, 0], full[:, t], atol=1e-4)
    cache = out.cache.advance(jnp.ones(B, jnp.int32))


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads():
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (2, 5, 6, 4))
  k = jax.random.normal(kk, (2, 5, 2, 4))
  v = jax.random.normal(kv, (2, 5, 2, 4))
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  mask = causal_mask(pos, pos)
  gqa = attend(q, k, v, mask)
  mha = attend(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), mask)
  np.testing.assert_allclose(gqa, mha, atol=1e-5)


def test_tied_head_uses_the_embedding_table_and_owns_no_lm_head(tokens):
  m = Decoder(CFG.replace(tie_embeddings=True, mtp=False), rngs=nnx.Rngs(0))
  assert m.lm_head is None
  out = m(tokens)
  expected = m.final_norm(out.hidden) @ m.embed[...].T
  np.testing.assert_allclose(out.logits, expected, atol=1e-5)
  names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m, nnx.Param))}
  assert not any("lm_head" in n for n in names)


def test_bfloat16_params_and_compute_stay_close_to_float32(tokens):
  m32 = Decoder(CFG.replace(mtp=False), rngs=nnx.Rngs(0))
  m16 = Decoder(CFG.replace(mtp=False, dtype="bfloat16", param_dtype="bfloat16"), rngs=nnx.Rngs(0))
  assert m16.embed[...].dtype == jnp.bfloat16
  a, b = m32(tokens).logits, m16(tokens).logits
  assert b.dtype == jnp.float32
  assert np.abs(a - b).max() < 0.05


def test_mtp_module_predicts_from_hidden_and_next_token_with_and_without_cache(model, tokens):
  out = model(tokens)
  mtp = model.mtp_forward(out.hidden[:, :-1], tokens[:, 1:])
  assert mtp.logits.shape == (B, T - 1, V)
  cache = model.init_mtp_cache(B, S)
  inc = model.mtp_forward(out.hidden[:, :4], tokens[:, 1:5], cache=cache)
  np.testing.assert_allclose(inc.logits, mtp.logits[:, :4], atol=1e-4)
  with pytest.raises(ValueError, match="MTP"):
    Decoder(CFG.replace(mtp=False), rngs=nnx.Rngs(0)).mtp_forward(out.hidden, tokens)


def test_llama3_rope_scaling_changes_only_low_frequencies():
  from specjax.models.layers import rope_frequencies
  from specjax.models.config import RopeScaling
  base = rope_frequencies(64, 500000.0, None)
  scaled = rope_frequencies(64, 500000.0, RopeScaling(factor=8.0, original_max_position=8192))
  np.testing.assert_allclose(scaled[:4], base[:4])
  np.testing.assert_allclose(scaled[-1], base[-1] / 8.0, rtol=1e-6)


@pytest.mark.parametrize("kw, field", [
    (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
    (dict(head_dim=7), "head_dim"),
    (dict(dtype="fp8"), "dtype"),
    (dict(aux_layers=(0, 9)), "aux_layers"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_bad_model_config_names_the_field(kw, field):
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    ModelConfig(**kw)


def test_char_tokenizer_round_trips_and_rejects_unknown_characters():
  tok = CharTokenizer()
  ids = tok.encode("12+7=19", bos=True, eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert tok.decode(ids) == "12+7=19"
  assert max(ids) < tok.vocab_size
  with pytest.raises(ValueError, match="not in the vocabulary"):
    tok.encode("é")
