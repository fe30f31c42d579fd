"""Memory-linear attention and per-layer rematerialisation equal the dense decoder (values, grads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import Decoder, ModelConfig
from specjax.models.attention import (
  causal_attention,
  causal_attention_with_own_keys,
  chunked_attention,
  has_fused_kernel,
)
from specjax.models.layers import attend, causal_mask

B, T, H, HKV, DH = 2, 37, 4, 2, 8


@pytest.fixture(scope="module")
def qkv():
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (B, T, H, DH))
  k = jax.random.normal(ks[1], (B, T, HKV, DH))
  v = jax.random.normal(ks[2], (B, T, HKV, DH))
  w = jax.random.normal(ks[3], (B, T, H, DH))
  return q, k, v, w


def _dense_with_lse(q, k, v):
  pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  mask = causal_mask(pos, pos)
  kk = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(q.shape[-1])
  lse = jax.nn.logsumexp(jnp.where(mask[:, None], s, -1e30), axis=-1).transpose(0, 2, 1)
  return attend(q, k, v, mask), lse


@pytest.mark.parametrize("block", [1, 8, 64])
def test_chunked_attention_equals_dense_attention_and_its_logsumexp(qkv, block):
  q, k, v, _ = qkv
  out, lse = jax.jit(chunked_attention, static_argnames="block")(q, k, v, block=block)
  ref_out, ref_lse = _dense_with_lse(q, k, v)
  np.testing.assert_allclose(out, ref_out, atol=2e-6)
  np.testing.assert_allclose(lse, ref_lse, atol=2e-6)


@pytest.mark.parametrize("block", [8, 64])
def test_chunked_attention_gradients_equal_dense_gradients(qkv, block):
  q, k, v, w = qkv

  def loss(fn):
    def f(q, k, v):
      out, lse = fn(q, k, v)
      return jnp.sum(out * w) + jnp.sum(jnp.sin(lse))  # cotangents on both outputs
    return f

  got = jax.jit(jax.grad(loss(lambda *a: chunked_attention(*a, block=block)), (0, 1, 2)))(q, k, v)
  want = jax.grad(loss(_dense_with_lse), (0, 1, 2))(q, k, v)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=1e-5)


def test_causal_attention_uses_the_chunked_path_on_cpu_and_block_zero_is_dense(qkv):
  q, k, v, _ = qkv
  assert not has_fused_kernel(jnp.bfloat16) or jax.default_backend() == "gpu"
  ref, _ = _dense_with_lse(q, k, v)
  attn = jax.jit(causal_attention, static_argnames="block")
  np.testing.assert_allclose(attn(q, k, v, block=0), ref, atol=2e-6)
  np.testing.assert_allclose(attn(q, k, v, block=5), ref, atol=2e-6)


CFG = ModelConfig(vocab_size=48, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_hidden=64, mtp=True)


@pytest.fixture(scope="module")
def dense_model():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (2, 21), 0, CFG.vocab_size)


def _with_config(model, **kw):
  state = nnx.state(model)
  other = Decoder(CFG.replace(**kw), rngs=nnx.Rngs(0))
  return nnx.merge(nnx.graphdef(other), state)


def _forward(model, tokens):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)


def _loss_and_grads(model, tokens):
  graphdef, state = nnx.split(model)

  @jax.jit
  @jax.value_and_grad
  def loss(state):
    m = nnx.merge(graphdef, state)
    out = m(tokens)
    mtp = m.mtp_forward(out.hidden[:, :-1], tokens[:, 1:])
    return (jnp.mean(jax.nn.log_softmax(out.logits)[..., 0]) + jnp.mean(out.aux_hidden ** 2)
            + jnp.mean(jax.nn.log_softmax(mtp.logits)[..., 1]))

  return loss(state)


@pytest.fixture(scope="module")
def dense_reference(dense_model, tokens):
  return _forward(dense_model, tokens), _loss_and_grads(dense_model, tokens)


@pytest.mark.parametrize("kw", [{"attention_block": 8, "remat": "full"},
                                {"remat": "dots"}])
def test_decoder_with_linear_attention_and_remat_equals_dense_decoder(dense_model, tokens,
                                                                      dense_reference, kw):
  model = _with_config(dense_model, **kw)
  ref, (ref_loss, ref_grads) = dense_reference
  out = _forward(model, tokens)
  np.testing.assert_allclose(out.logits, ref.logits, atol=1e-5)
  np.testing.assert_allclose(out.aux_hidden, ref.aux_hidden, atol=1e-5)
  loss, grads = _loss_and_grads(model, tokens)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, atol=1e-6)


def test_cached_decode_is_unaffected_by_the_attention_block(dense_model, tokens):
  model = _with_config(dense_model, attention_block=4)
  cache = model.init_cache(2, 32)
  out = model(tokens, cache=cache)
  ref = dense_model(tokens, cache=dense_model.init_cache(2, 32))
  np.testing.assert_allclose(out.logits, ref.logits, atol=1e-5)


def test_model_config_rejects_bad_attention_block_and_remat():
  with pytest.raises(ValueError, match="ModelConfig.attention_block"):
    ModelConfig(attention_block=-1)
  with pytest.raises(ValueError, match="ModelConfig.remat"):
    ModelConfig(remat="some")
  assert hash(ModelConfig(attention_block=8, remat="dots")) == hash(
      ModelConfig(attention_block=8, remat="dots"))


def test_attention_with_own_keys_equals_masked_attention_over_all_keys(qkv):
  # EAGLE-3 TTT step 2 of 3: causal over block 0, the same position only in blocks 1 and 2
  q, k, v, w = qkv
  extra = [jax.random.normal(jax.random.key(i), (2,) + k.shape) for i in (5, 6)]
  own_k, own_v = [e[0] for e in extra], [e[1] for e in extra]
  eye = jnp.eye(T, dtype=bool)
  mask = jnp.concatenate([jnp.tril(jnp.ones((T, T), bool)), eye, eye], axis=1)[None]
  keys, vals = jnp.concatenate([k] + own_k, axis=1), jnp.concatenate([v] + own_v, axis=1)
  dense = lambda q, k, v: attend(q, jnp.concatenate([k] + own_k, 1),
                                 jnp.concatenate([v] + own_v, 1), mask)
  linear = lambda q, k, v: causal_attention_with_own_keys(q, k, v, own_k, own_v, block=8)
  np.testing.assert_allclose(jax.jit(linear)(q, k, v), attend(q, keys, vals, mask), atol=2e-6)
  objective = lambda fn: lambda *a: jnp.sum(fn(*a) * w)
  got = jax.jit(jax.grad(objective(linear), (0, 1, 2)))(q, k, v)
  want = jax.grad(objective(dense), (0, 1, 2))(q, k, v)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=1e-5)


@pytest.mark.parametrize("t", [1, 5])
def test_cache_attention_in_chunks_equals_reading_the_whole_cache_and_reads_only_the_live_extent(t):
  """`attend_cache` read in chunks of 8 (a width that does not divide the 37 positions, so the
  last chunk overlaps the one before) against one read of the whole buffers; ragged rows, one
  row that sees no key (returns 0). Keys and values past the last chunk any query sees are NaN:
  the chunked read never touches them."""
  from specjax.models.layers import attend_cache
  b, s, h, hkv, dh = 4, 37, 4, 2, 8
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (b, t, h, dh))
  k = jax.random.normal(ks[1], (b, hkv, dh, s))
  v = jax.random.normal(ks[2], (b, hkv, s, dh))
  start = jnp.array([3, 17, 0, 9])
  qpos = start[:, None] + jnp.arange(t)[None]
  mask = jnp.arange(s)[None, None, :] <= qpos[:, :, None]
  mask = mask.at[2].set(False)  # a row with no visible key
  whole = attend_cache(q, k, v, mask, chunk=s)
  in_chunks = attend_cache(q, k, v, mask, chunk=8, min_bytes=0)
  np.testing.assert_allclose(in_chunks, whole, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(whole[2], 0.0)
  reach = -(-(17 + t) // 8) * 8  # chunks of 8 up to the last visible position
  k_nan = k.at[..., reach:].set(jnp.nan)
  v_nan = v.at[:, :, reach:].set(jnp.nan)
  chunked = attend_cache(q, k_nan, v_nan, mask, chunk=8, min_bytes=0)
  np.testing.assert_allclose(chunked, whole, atol=1e-5, rtol=1e-5)
  # the whole read touches them (the check above is not vacuous)
  assert np.isnan(np.asarray(attend_cache(q, k_nan, v_nan, mask, chunk=s))).any()


@pytest.mark.parametrize("t", [1, 5, 9])
def test_a_step_reaching_the_last_chunk_reads_the_cache_in_one_pass_with_the_same_result(
    t, monkeypatch):
  """A decode or verify step (at most `SUMS_MAX_QUERIES` queries per kv head: 2 and 10 here, 18
  at t = 9 is more) whose furthest row is in the last chunk reads the buffers whole in one pass
  of multiply-and-sum; otherwise it loops over the chunks. Both branches equal the whole read
  (ragged rows, a row that sees no key), and so does the loop alone."""
  from specjax.models import cache
  from specjax.models.layers import attend_cache
  b, s, h, hkv, dh = 4, 37, 4, 2, 8
  q, k, v, _ = _cache_problem(11, b, s, t, h, hkv, dh)
  for start in ([3, 33, 0, 9], [3, 17, 0, 9]):  # furthest row in the last chunk of 8, or not
    qpos = jnp.asarray(start)[:, None] + jnp.arange(t)[None]
    mask = (jnp.arange(s)[None, None, :] <= qpos[:, :, None]).at[2].set(False)
    whole = attend_cache(q, k, v, mask, chunk=s)
    attend = lambda *a: attend_cache(*a, chunk=8, min_bytes=0)  # (fresh: traces are cached)
    np.testing.assert_allclose(jax.jit(attend)(q, k, v, mask), whole, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(jax.jit(attend)(q, k, v, mask)[2], 0.0)
    assert ("cond[" in str(jax.make_jaxpr(attend)(q, k, v, mask))) == (t * h // hkv <= 16)
  monkeypatch.setattr(cache, "SUMS_MAX_QUERIES", 0)
  loop = lambda *a: attend_cache(*a, chunk=8, min_bytes=0)
  assert "cond[" not in str(jax.make_jaxpr(loop)(q, k, v, mask))
  np.testing.assert_allclose(jax.jit(loop)(q, k, v, mask), whole, atol=1e-5, rtol=1e-5)


def _cache_problem(seed: int, b: int, s: int, t: int, h: int = 4, hkv: int = 2, dh: int = 8):
  """Random q [B, T, H, Dh], cache buffers k [B, Hkv, Dh, S] and v [B, Hkv, S, Dh] (`KVCache`
  layout), and output weights w [B, T, H, Dh] for a scalar loss."""
  ks = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(ks[0], (b, t, h, dh)), jax.random.normal(ks[1], (b, hkv, dh, s)),
          jax.random.normal(ks[2], (b, hkv, s, dh)), jax.random.normal(ks[3], (b, t, h, dh)))


def test_cache_attention_read_in_chunks_has_the_whole_reads_gradient():
  """A loop of dynamic length has no reverse mode: the chunked read's gradient is the whole
  read's (EAGLE-3's training-time test differentiates through cached attention)."""
  from specjax.models.layers import attend_cache
  b, s, t = 2, 37, 3
  q, k, v, w = _cache_problem(5, b, s, t)
  qpos = jnp.array([20, 9])[:, None] + jnp.arange(t)[None]
  mask = jnp.arange(s)[None, None, :] <= qpos[:, :, None]
  loss = lambda chunk, min_bytes: lambda q, k, v: jnp.sum(
      w * attend_cache(q, k, v, mask, chunk=chunk, min_bytes=min_bytes))
  want = jax.grad(loss(s, None), argnums=(0, 1, 2))(q, k, v)
  got = jax.jit(jax.grad(loss(8, 0), argnums=(0, 1, 2)))(q, k, v)
  for g, x in zip(got, want):
    np.testing.assert_allclose(g, x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk,min_bytes", [(37, None), (8, 0)])
def test_a_prefill_attends_in_query_blocks_with_the_results_and_gradient_of_one_block(
    chunk, min_bytes):
  """More queries than `query_block` (a prefill) attend a block at a time, so the scores held at
  once do not grow with the prompt: 23 queries in blocks of 4 (the last one padded) equal one
  block of all 23, values and gradients, whole reads and chunked; a row that sees no key
  returns 0; the scores in the program are [.., 4, S], never [.., 23, S]."""
  from specjax.models.layers import attend_cache
  b, s, t = 3, 37, 23
  q, k, v, w = _cache_problem(7, b, s, t)
  qpos = jnp.array([0, 14, 3])[:, None] + jnp.arange(t)[None]
  mask = (jnp.arange(s)[None, None, :] <= qpos[:, :, None]).at[2].set(False)
  attn = lambda block: lambda q, k, v: attend_cache(q, k, v, mask, chunk=chunk,
                                                    min_bytes=min_bytes, query_block=block)
  one, blocks = attn(t), attn(4)
  np.testing.assert_allclose(jax.jit(blocks)(q, k, v), one(q, k, v), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(jax.jit(blocks)(q, k, v)[2], 0.0)
  loss = lambda f: lambda q, k, v: jnp.sum(w * f(q, k, v))
  want = jax.grad(loss(one), argnums=(0, 1, 2))(q, k, v)
  got = jax.jit(jax.grad(loss(blocks), argnums=(0, 1, 2)))(q, k, v)
  for g, x in zip(got, want):
    np.testing.assert_allclose(g, x, atol=1e-5, rtol=1e-5)
  if min_bytes is None:  # whole reads: scores [B, Hkv, G, queries, S]
    text = lambda f: str(jax.make_jaxpr(f)(q, k, v))
    assert "f32[3,2,2,23,37]" in text(one)
    assert "f32[3,2,2,23,37]" not in text(blocks) and "f32[3,2,2,4,37]" in text(blocks)


def test_cache_attention_reads_in_chunks_only_on_the_chunked_read_backends(monkeypatch):
  """By default `attend_cache` and the pure-JAX paged path loop over chunks on CPU (for buffers
  past the byte floor) and read whole elsewhere: on a GPU a loop of dynamic length hands its
  condition to the host at every iteration. The backend list is read at trace time."""
  from specjax.models import cache, paged_attention
  from specjax.models.layers import attend_cache
  b, s, h, hkv, dh = 2, 64, 4, 2, 8
  q = jnp.ones((b, 1, h, dh))
  k, v = jnp.ones((b, hkv, dh, s)), jnp.ones((b, hkv, s, dh))
  mask = jnp.ones((b, 1, s), bool)
  pool = jnp.ones((hkv, 8, 8, dh))
  table, lengths, start = jnp.arange(8).reshape(b, 4), jnp.full((b,), 32), jnp.full((b,), 31)
  monkeypatch.setattr(cache, "CACHE_CHUNK", 16)
  monkeypatch.setattr(cache, "CACHE_CHUNK_MIN_BYTES", 0)

  def loops() -> tuple[bool, bool]:  # (fresh functions: traces are cached per function)
    dense = jax.make_jaxpr(lambda *a: attend_cache(*a))(q, k, v, mask)
    pages = jax.make_jaxpr(lambda *a: paged_attention.paged_attention_chunked(*a))(
        q, pool, pool, table, lengths, start)
    return "while" in str(dense), "while" in str(pages)

  assert jax.default_backend() == "cpu" and loops() == (True, True)
  monkeypatch.setattr(cache, "CHUNKED_READ_BACKENDS", ("gpu",))
  assert loops() == (False, False)
  # an explicit byte floor still chooses the chunked read on any backend
  assert "while" in str(jax.make_jaxpr(
      lambda *a: attend_cache(*a, min_bytes=0))(q, k, v, mask))
