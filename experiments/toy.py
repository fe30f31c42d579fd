"""Toy corpora and a tiny pretrained target for drafter tests and benchmarks (CPU-sized; scaffolding,
not library code: tests import it as `experiments.toy`, benchmarks as `toy`).

In-domain: character-level chained additions "Q:12+7+30=?A:12+7=19,19+30=49.#49"; general: simple
English sentences. The target is pretrained on both, jointly with its MTP module when it has one.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from specjax.jobs.pretrain import LmTrainConfig, train_lm
from specjax.models.config import ModelConfig
from specjax.models.decoder import Decoder
from specjax.models.tokenizer import CharTokenizer

_SUBJECTS = ("the cat", "a dog", "the bird", "my friend", "a fox", "the child")
_VERBS = ("sees", "likes", "runs to", "eats", "hears", "finds")
_OBJECTS = ("the fish", "a ball", "the tree", "some bread", "a cat", "the dog")


def arithmetic_example(rng: np.random.Generator) -> tuple[str, str]:
  """(prompt, completion): add 2-3 numbers step by step, then state the answer after '#'."""
  terms = [int(x) for x in rng.integers(1, 60, size=int(rng.integers(2, 4)))]
  steps, total = [], terms[0]
  for t in terms[1:]:
    steps.append(f"{total}+{t}={total + t}")
    total += t
  return "Q:" + "+".join(map(str, terms)) + "=?A:", ",".join(steps) + f".#{total}"


def general_example(rng: np.random.Generator) -> tuple[str, str]:
  """(prompt, completion): two sentences; the second starts from the first one's object."""
  s, v, o = (int(i) for i in rng.integers(0, 6, size=3))
  v2, o2 = (int(i) for i in rng.integers(0, 6, size=2))
  first = f"{_SUBJECTS[s]} {_VERBS[v]} {_OBJECTS[o]}."
  second = f" {_OBJECTS[o]} {_VERBS[v2]} {_OBJECTS[o2]}."
  cut = len(_SUBJECTS[s]) + 1
  return first[:cut], first[cut:] + second


def examples(kind: str, n: int, seed: int) -> list[tuple[str, str]]:
  make = {"arithmetic": arithmetic_example, "general": general_example}[kind]
  rng = np.random.default_rng(seed)
  return [make(rng) for _ in range(n)]


def encode_prompts(tok: CharTokenizer, prompts: list[str], width: int | None = None):
  """Right-padded [BOS] + prompt ids and their lengths."""
  ids = [tok.encode(p, bos=True) for p in prompts]
  width = width or max(map(len, ids))
  out = np.full((len(ids), width), tok.pad_id, np.int32)
  for i, row in enumerate(ids):
    out[i, :len(row)] = row
  return out, np.asarray([len(r) for r in ids], np.int32)


def encode_texts(tok: CharTokenizer, pairs: list[tuple[str, str]], width: int):
  """[BOS] + prompt + completion + [EOS], padded to `width`; mask of the non-pad tokens."""
  out = np.full((len(pairs), width), tok.pad_id, np.int32)
  for i, (p, c) in enumerate(pairs):
    row = tok.encode(p + c, bos=True, eos=True)[:width]
    out[i, :len(row)] = row
  return out, out != tok.pad_id


def toy_target_config(mtp: bool = True, **overrides) -> ModelConfig:
  base = dict(vocab_size=CharTokenizer().vocab_size, hidden_size=64, num_layers=4, num_heads=4,
              num_kv_heads=2, head_dim=16, mlp_hidden=128, mtp=mtp)
  return ModelConfig(**{**base, **overrides})


def pretrain_toy_target(cfg: ModelConfig | None = None, *, steps: int = 400, num_texts: int = 2000,
                        width: int = 64, seed: int = 0, progress: bool = False) -> Decoder:
  """A tiny decoder trained on a 50/50 mix of both corpora (LM + MTP when cfg.mtp)."""
  cfg = cfg or toy_target_config()
  tok = CharTokenizer()
  pairs = examples("arithmetic", num_texts // 2, seed) + examples("general", num_texts // 2,
                                                                  seed + 1)
  tokens, mask = encode_texts(tok, pairs, width)
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  lm_cfg = LmTrainConfig(steps=steps, warmup_steps=min(20, steps // 10), seed=seed)
  model, _ = train_lm(model, tokens, mask, lm_cfg,
                      progress=progress)
  return model


def tiny_random_config(**overrides) -> ModelConfig:
  """The random target of the fast drafter tests: peaked outputs (init_std 0.5), an MTP module."""
  base = dict(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
              head_dim=16, mlp_hidden=64, init_std=0.5, mtp=True)
  return ModelConfig(**{**base, **overrides})


def tiny_prompts(num: int, seed: int, width: int = 8, vocab_size: int = 32):
  """Random ragged prompts [num, width] (ids 1 .. V-1, lengths 2 .. width) for the tiny target."""
  rng = np.random.default_rng(seed)
  prompts = rng.integers(1, vocab_size, size=(num, width)).astype(np.int32)
  lengths = rng.integers(2, width + 1, size=num).astype(np.int32)
  prompts[np.arange(width)[None, :] >= lengths[:, None]] = 0
  return prompts, lengths
