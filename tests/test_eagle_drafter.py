"""The Eagle3Drafter in the speculative loop: its chained drafts are the TTT unrolled steps, greedy
output equals AR greedy, temperature-1 output is distributed as AR sampling, and trained heads
(in-domain beats general) raise the acceptance length on a tiny pretrained arithmetic target."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import stats
from specjax.drafters import (DraftTrainConfig, Eagle3Head, HeadConfig, build_vocab_maps,
                           collect_rollouts, draft_to_target_probs, eagle3_drafter, identity_maps,
                           init_head, train_draft_head, ttt_forward)
from experiments import toy
from specjax.models import Decoder
from specjax.models.tokenizer import CharTokenizer
from specjax.sampling.adaptive import DraftLenPolicy
from specjax.sampling import STATIC, EngineConfig
from specjax.sampling import (AcceptanceMetrics, SamplingConfig, TargetStep, generate,
                              speculative_generate)

# the tiny target, sampling and training of test_eagle_ttt: the compiled programs are shared
CFG = toy.tiny_random_config()
SAMPLING = SamplingConfig(max_new_tokens=16, temperature=1.0)
GREEDY = SamplingConfig(max_new_tokens=16, temperature=0.0, eos_ids=(13,))
TRAIN = DraftTrainConfig(steps=80, batch_size=16, lr=3e-3, warmup_steps=5,
                         draft_vocab=24)
K = 3


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def trained(target):
  rollouts = collect_rollouts(target, *toy.tiny_prompts(96, seed=0), jax.random.key(0), SAMPLING)
  return train_draft_head(target, rollouts=rollouts, config=TRAIN, progress=False)


def test_chained_drafts_are_the_ttt_unrolled_steps_at_the_last_committed_pair(target):
  head = Eagle3Head(HeadConfig(CFG.replace(init_std=0.3), 24), rngs=nnx.Rngs(1))
  maps = build_vocab_maps(np.arange(CFG.vocab_size)[::-1], CFG.vocab_size, 24)
  drafter, params = eagle3_drafter(head, target.embed[...], maps, draft_len=4)
  prompts, lengths = toy.tiny_prompts(2, seed=3, width=7)
  prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
  sampled = jnp.array([3, 5], jnp.int32)  # the token the target sampled after each prompt
  rows = jnp.arange(2)

  @jax.jit
  def draft(params, key):
    out = target(prompts)
    nxt = jnp.concatenate([prompts[:, 1:], prompts[:, :1]], 1).at[rows, lengths - 1].set(sampled)
    state = drafter.init(params, 2, 16)
    state = drafter.observe(params, state, TargetStep(prompts, nxt, jnp.zeros(2, jnp.int32),
                                                      lengths, out))
    return drafter.propose(params, state, None, key)[:2]

  tokens, probs = draft(params, jax.random.key(0))
  full = np.zeros((2, 12), np.int32)
  for b in range(2):
    n = int(lengths[b])
    full[b, :n], full[b, n], full[b, n + 1:n + 5] = prompts[b, :n], sampled[b], tokens[b]

  @jax.jit
  def unrolled(full):  # teacher forcing the drafts: TTT step i at the last prompt pair = draft i+1
    return ttt_forward(head, target.embed[...], target(full).aux_hidden, full, 4)

  step_logits = unrolled(jnp.asarray(full))
  for i in range(4):
    want = draft_to_target_probs(jax.nn.softmax(step_logits[i], -1), maps)[rows, lengths - 1]
    np.testing.assert_allclose(probs[:, i], want, atol=1e-5)
  assert np.all(np.asarray(maps.t2d)[np.asarray(tokens)])


def test_greedy_eagle_draft_trees_equal_greedy_autoregressive_and_accept_more(target, trained):
  prompts, lengths = toy.tiny_prompts(8, seed=4)
  ar = generate(target, prompts, lengths, jax.random.key(0), GREEDY, engine=STATIC)
  accepted = {}
  for width in (1, 3):
    drafter, params = eagle3_drafter(trained.head, target.embed[...], trained.maps, draft_len=K)
    drafter = dataclasses.replace(drafter, tree_width=width)
    # (the chain's adaptive engine is tested above; the tree's chooses chain or tree per segment)
    for engine in (STATIC,) if width == 1 else (STATIC, EngineConfig()):
      out = speculative_generate(target, drafter, params, prompts, lengths, jax.random.key(1),
                                 GREEDY, engine=engine)
      np.testing.assert_array_equal(out.tokens, ar.tokens)
      np.testing.assert_array_equal(out.lengths, ar.lengths)
      if engine is STATIC:
        m = AcceptanceMetrics.from_counts(out.stats)
        accepted[width] = m.num_accepted_tokens / m.num_drafts
  assert accepted[3] > accepted[1]


@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_greedy_speculative_with_an_eagle_head_equals_greedy_autoregressive(target, trained,
                                                                            which):
  prompts, lengths = toy.tiny_prompts(8, seed=4)
  if which == "trained":
    head, maps = trained.head, trained.maps
  else:
    head, maps = init_head(CFG, 24, seed=5), trained.maps
  drafter, params = eagle3_drafter(head, target.embed[...], maps, draft_len=K)
  ar = generate(target, prompts, lengths, jax.random.key(0), GREEDY, engine=STATIC)
  # the plain loop, K fixed: deterministic, so it also pins that the trained head gets accepted
  static = speculative_generate(target, drafter, params, prompts, lengths, jax.random.key(1),
                                GREEDY, engine=STATIC)
  np.testing.assert_array_equal(static.tokens, ar.tokens)
  np.testing.assert_array_equal(static.lengths, ar.lengths)
  if which == "trained":
    assert AcceptanceMetrics.from_counts(static.stats).num_accepted_tokens > 0
  # the adaptive engine (compaction, K in 0..3 per bucket). Its K choices follow measured step
  # costs, so only the output is asserted: whether and how much it drafts after the first segment
  # is not. A call without `tuning` starts from a fresh estimate, so its first segment drafts.
  adaptive = speculative_generate(target, drafter, params, prompts, lengths, jax.random.key(1),
                                  GREEDY)
  np.testing.assert_array_equal(adaptive.tokens, ar.tokens)
  np.testing.assert_array_equal(adaptive.lengths, ar.lengths)
  assert adaptive.segments[0].draft_len >= 1 and int(adaptive.stats.num_drafts.sum()) > 0


def test_greedy_eagle_speculation_equals_greedy_ar_for_any_sequence_of_draft_lengths(
    target, trained, monkeypatch):
  """The engine's K choice (timings, acceptance) must not matter for the output: a fixed schedule
  that changes K every two steps covers plain-AR steps in which the head only observes, drafting
  resumed after them, K switching between segments, and the head's state gathered by compaction.
  (Greedy AR's top-2 logit margin on these prompts is >= 7.5e-3, while a T = 1 and a T = K + 1
  forward differ by ~1e-5: an output difference here could only be a bug, not a near-tie.)"""
  prompts, lengths = toy.tiny_prompts(8, seed=4)
  drafter, params = eagle3_drafter(trained.head, target.embed[...], trained.maps, draft_len=K)
  ar = generate(target, prompts, lengths, jax.random.key(0), GREEDY, engine=STATIC)
  schedule = itertools.cycle((3, 0, 1, 3, 2, 0, 2, 1))
  monkeypatch.setattr(DraftLenPolicy, "choose",
                      lambda self, *args: (next(schedule), float("nan")))
  # and every segment 2 steps long, K = 0 too (the engine runs a K = 0 bucket to its end, since
  # its own choice could not change there; this schedule does change it)
  monkeypatch.setattr(DraftLenPolicy, "budget", lambda self, *args: 2)
  engine = EngineConfig()
  out = speculative_generate(target, drafter, params, prompts, lengths, jax.random.key(1), GREEDY,
                             engine=engine)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  np.testing.assert_array_equal(out.lengths, ar.lengths)
  ks = [s.draft_len for s in out.segments]
  assert {(0, 1), (0, 2), (1, 3), (3, 2)} <= set(itertools.pairwise(ks))
  assert {s.bucket for s in out.segments} == {8, 4, 2, 1}  # compaction down to one row ...
  assert {s.bucket for s in out.segments if s.draft_len > 0} >= {8, 4}  # ... drafting after it
  assert AcceptanceMetrics.from_counts(out.stats).num_accepted_tokens > 0


# -- temperature 1 with sampled proposals: distributed exactly as AR sampling -------------------

ROWS = 4096  # per sampler
SAMPLE = SamplingConfig(max_new_tokens=5, temperature=1.0)
POSITIONS = (1, 2, 3, 4)
ALPHA = 1e-3  # family-wise over the positions and the pair test (Bonferroni)


def test_sampled_eagle_proposals_leave_the_rollout_distribution_unchanged(target, trained):
  prompts, lengths = toy.tiny_prompts(2, seed=6)
  prompts = np.tile(prompts, (ROWS // 2, 1))
  lengths = np.tile(lengths, ROWS // 2)
  drafter, params = eagle3_drafter(trained.head, target.embed[...], trained.maps, draft_len=K)
  ar = generate(target, prompts, lengths, jax.random.key(10), SAMPLE)
  # K = 3 at every step: every draft is a whole chain of head steps, so later chain positions are
  # accepted often enough to be tested (the adaptive engine drafted mostly K = 1 here on a CPU),
  # and the samples do not depend on the machine's timings. The engine's compaction and adaptive
  # K are tested for losslessness in test_speculative.
  spec = speculative_generate(target, drafter, params, prompts, lengths, jax.random.key(20),
                              SAMPLE, engine=STATIC)
  m = AcceptanceMetrics.from_counts(spec.stats)
  assert m.num_accepted_tokens > ROWS // 4, f"too few accepted drafts ({m}) to be a test"
  outside = ~np.asarray(trained.maps.t2d)[np.asarray(spec.tokens)[:, 1:]]
  assert outside.sum() > 50  # tokens the head cannot propose still come out, via the residual
  v = CFG.vocab_size
  cat = lambda out: np.asarray(out.tokens) + v * (np.arange(ROWS) % 2)[:, None]  # (prompt, token)
  a, b = cat(ar), cat(spec)
  alpha = stats.bonferroni(ALPHA, len(POSITIONS) + 1)
  for j in POSITIONS:
    stats.assert_two_sample_same(a[:, j], b[:, j], 2 * v, alpha, what=f"position {j}")
  stats.assert_two_sample_same(stats.pair_index(a[:, 1], a[:, 2], 2 * v),
                               stats.pair_index(b[:, 1], b[:, 2], 2 * v), (2 * v) ** 2, alpha,
                               what="positions (1, 2)")


# -- a tiny pretrained arithmetic target: trained > untrained, in-domain > general ---------------

ARITH = SamplingConfig(max_new_tokens=24, temperature=1.0, eos_ids=CharTokenizer().eos_ids,
                       pad_id=CharTokenizer().pad_id)
HEAD_TRAIN = DraftTrainConfig(steps=100, batch_size=16, warmup_steps=10)


@pytest.fixture(scope="module")
def arithmetic():
  """Target pretrained on arithmetic + English; heads trained on either prompt set; acceptance
  length at K = 3 on held-out arithmetic prompts."""
  tok = CharTokenizer()
  cfg = toy.toy_target_config(mtp=False, hidden_size=32, num_layers=2, mlp_hidden=64, head_dim=8)
  model = toy.pretrain_toy_target(cfg, steps=200, width=48)
  prompt_set = lambda kind, n, seed: toy.encode_prompts(
      tok, [p for p, _ in toy.examples(kind, n, seed)], width=16)
  heads = {"untrained": (init_head(cfg), identity_maps(cfg.vocab_size))}
  for kind in ("arithmetic", "general"):
    res = train_draft_head(model, *prompt_set(kind, 128, 11), sampling=ARITH, config=HEAD_TRAIN,
                           progress=False)
    heads[kind] = (res.head, res.maps)
  held_out = prompt_set("arithmetic", 32, 99)
  lengths = {}
  for name, (head, maps) in heads.items():
    drafter, params = eagle3_drafter(head, model.embed[...], maps, draft_len=K)
    # a fixed K: the comparison is of the heads, not of the engine's choice of K
    out = speculative_generate(model, drafter, params, *held_out, jax.random.key(3), ARITH,
                               engine=STATIC)
    lengths[name] = AcceptanceMetrics.from_counts(out.stats).acceptance_length
  return lengths


@pytest.mark.slow
def test_a_trained_head_has_a_longer_acceptance_length_than_an_untrained_one(arithmetic):
  assert arithmetic["arithmetic"] > arithmetic["untrained"] + 0.5, arithmetic


@pytest.mark.slow
def test_an_in_domain_head_beats_a_general_head_on_the_rl_task(arithmetic):
  assert arithmetic["arithmetic"] > arithmetic["general"] + 0.3, arithmetic
