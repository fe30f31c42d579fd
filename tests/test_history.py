"""History drafting: each prompt's earlier completions as the drafter's corpus. The store keeps
its caps; the device finds a row's entries by the prompt's hash; drafts continue the aligned
occurrence; the speculative loop keeps the target's output (greedy: token for token, through the
queue and compaction; temperature 1: in distribution, with a stale history and an inner drafter
whose own drafts carry probabilities, and with drafts drawn from the history's counts, whose
spread q the verifier's residual corrects; the queue tests' target, prompts and two-sample
checks)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from broken_verifier import verify_without_residual
from test_queue import CFG, ROWS, SAMPLE, assert_same_distribution, stat_prompts
from specjax.drafters import (CorpusStore, DraftModelDrafter, HistoryDrafter, HistoryParams,
                              HistoryStore, corpus_lookup, history_lookup, prompt_key,
                              prompt_keys, truncated_copy)
from specjax.drafters.token_hash import window_keys
from specjax.errors import UserError
from specjax.models import Decoder
from specjax.models.decoder import DecoderOutput
from specjax.sampling import (STATIC, EngineConfig, SamplingConfig, Sequences, generate,
                              segment, speculative_generate)
from specjax.sampling.engine_config import AdaptiveConfig, QueueConfig
from specjax.sampling.drafter import TargetStep
from specjax.sampling.metrics import AcceptanceMetrics

_rng = np.random.default_rng(11)
PROMPTS = jnp.asarray(_rng.integers(3, 32, (12, 6)), jnp.int32)
PROMPT_LENGTHS = jnp.asarray(_rng.integers(2, 7, 12), jnp.int32)
GREEDY = SamplingConfig(max_new_tokens=20, temperature=0.0, eos_ids=(1, 2))


def test_the_prompt_hash_is_the_same_on_the_host_and_the_device():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 50_000, (64, 40)).astype(np.int32)
  lengths = rng.integers(1, 41, 64).astype(np.int32)
  device = np.asarray(jax.jit(prompt_keys)(jnp.asarray(tokens), jnp.asarray(lengths)))
  host = [prompt_key(t[:n]) for t, n in zip(tokens, lengths)]
  assert device.tolist() == host
  assert len(set(host)) == 64
  # what lies beyond a prompt's length does not change its key; a token or the length does
  garbage = tokens.copy()
  garbage[0, lengths[0]:] = 7
  assert prompt_key(garbage[0, :lengths[0]]) == host[0]
  assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 4]) != prompt_key([1, 2])
  assert prompt_key([0]) != prompt_key([0, 0])


def test_the_store_keeps_each_prompts_latest_completions_within_its_caps():
  store = HistoryStore(max_prompts=3, per_prompt=2, width=6, tail=2)
  nbytes = store.nbytes
  prompts = np.array([[5, 6, 7], [8, 9, 0], [10, 11, 12], [13, 14, 0]])
  plens = np.array([3, 2, 3, 2])
  # round r: completions 20 + r, r + 1 tokens long; round 0 records all four prompts (the fourth
  # evicts the first), rounds 1 and 2 the last three
  for round_ in range(3):
    rows = slice(0 if round_ == 0 else 1, 4)
    comp = np.full((4, 8), 20 + round_)[rows]
    store.record(prompts[rows], plens[rows], comp, np.full((4,), round_ + 1)[rows])
  assert store.prompts == 3 and store.recorded == 10 and store.nbytes == 3 * 2 * (6 + 1) * 4
  assert nbytes == 0  # memory is taken as prompts are recorded
  table = store.table()
  assert table.tokens.shape == (3, 2, 6)
  held = {(int(k), int(n)) for k, n in zip(table.keys, table.prompt_lengths)}
  want = {(prompt_key(p[:n]), int(n)) for p, n in zip(prompts[1:], plens[1:])}
  assert held == want  # prompt 0 was the least recently recorded: evicted
  slot = [i for i in range(3) if int(table.keys[i]) == prompt_key([13, 14])][0]
  entries = sorted(np.asarray(table.tokens[slot, e, :table.lengths[slot, e]]).tolist()
                   for e in range(2))
  assert entries == [[13, 14, 21, 21], [13, 14, 22, 22, 22]]  # rounds 1 and 2; round 0 gone
  # an entry is cut at the width
  store.record(prompts[:1], plens[:1], np.arange(30, 38)[None], np.array([8]))
  t = store.table()
  slot = [i for i in range(3) if int(t.keys[i]) == prompt_key([5, 6, 7])][0]
  assert np.asarray(t.tokens[slot, 0]).tolist() == [6, 7, 30, 31, 32, 33]
  # a JSON round trip restores everything; a store of another shape refuses it
  again = HistoryStore(max_prompts=3, per_prompt=2, width=6, tail=2)
  again.load_json(store.to_json())
  for a, b in zip(jax.tree.leaves(again.table()), jax.tree.leaves(store.table())):
    np.testing.assert_array_equal(a, b)
  assert again.to_json() == store.to_json()
  with pytest.raises(ValueError, match="history_per_prompt"):
    HistoryStore(max_prompts=3, per_prompt=3, width=6, tail=2).load_json(store.to_json())
  with pytest.raises(ValueError, match="HistoryStore.width"):
    HistoryStore(max_prompts=3, per_prompt=2, width=2, tail=2)


@pytest.mark.parametrize("damage,problem", [
    (lambda d: d.pop("prompts"), r"no 'prompts'"),
    (lambda d: d.update(recorded="7"), r"'recorded' is '7', not an int"),
    (lambda d: d["prompts"][0].pop("entries"), r"prompts\[0\] has no 'entries'"),
    (lambda d: d["prompts"][1]["entries"].__setitem__(1, [1, "x"]),
     r"prompts\[1\].entries\[1\] is not a list of token ids"),
    (lambda d: d["prompts"][1].update(key=d["prompts"][0]["key"],
                                      prompt_length=d["prompts"][0]["prompt_length"]),
     r"prompts\[1\] repeats an earlier prompt's key"),
    (lambda d: d["prompts"].extend(d["prompts"][:2]), r"4 prompts, for 3"),
    (lambda d: d["prompts"][0]["entries"][0].extend([1] * 9),
     r"prompts\[0\].entries\[0\] has \d+ tokens \(at most 6\)"),
], ids=["no-prompts", "recorded-str", "no-entries", "bad-token", "repeated", "too-many",
        "long-entry"])
def test_a_malformed_saved_history_names_what_is_wrong_and_leaves_the_store_as_it_was(damage,
                                                                                      problem):
  store = HistoryStore(max_prompts=3, per_prompt=2, width=6, tail=2)
  store.record(np.array([[5, 6, 7], [8, 9, 0]]), np.array([3, 2]), np.full((2, 4), 20),
               np.array([2, 3]))
  saved = store.to_json()
  damage(saved)
  before = store.to_json()
  with pytest.raises(UserError, match=rf"HistoryStore: the saved drafting history is malformed "
                                      rf"\({problem}.*\); resume from another checkpoint"):
    store.load_json(saved)
  assert store.to_json() == before


def test_history_lookup_continues_the_occurrence_aligned_with_the_row():
  # entry: the prompt's last 2 tokens, then 4 9 5 4 9 6 7; the row (prompt 8 3, completion 4 9)
  # ends in "4 9", which occurs at entry positions 2 and 5: the aligned one (2) continues 5 4 9
  hist = jnp.asarray([[[8, 3, 4, 9, 5, 4, 9, 6, 7, 0], [0] * 10]], jnp.int32)
  hist_len = jnp.asarray([[9, 0]], jnp.int32)
  seq = Sequences(tokens=jnp.asarray([[8, 3, 4, 9, 0, 0]], jnp.int32),
                  lengths=jnp.asarray([4], jnp.int32), prompt_lengths=jnp.asarray([2], jnp.int32))
  drafts, matched = history_lookup(seq, hist, hist_len, 3, 2, 1, 2)
  assert drafts.tolist() == [[5, 4, 9]] and matched.tolist() == [2]
  # four completion tokens later (4 9 5 4 9) the aligned occurrence is the second one, and its
  # continuation is clamped at the entry's last token
  seq = seq.replace(tokens=jnp.asarray([[8, 3, 4, 9, 5, 4, 9, 0]], jnp.int32),
                    lengths=jnp.asarray([7], jnp.int32))
  drafts, matched = history_lookup(seq, hist, hist_len, 3, 2, 1, 2)
  assert drafts.tolist() == [[6, 7, 7]] and matched.tolist() == [2]
  # no occurrence: nothing matched
  seq = seq.replace(tokens=jnp.asarray([[8, 3, 11, 12, 0, 0, 0, 0]], jnp.int32),
                    lengths=jnp.asarray([4], jnp.int32))
  assert history_lookup(seq, hist, hist_len, 3, 2, 1, 2)[1].tolist() == [0]


def test_the_cross_prompt_table_drafts_what_followed_a_context_in_any_earlier_rollout():
  rng = np.random.default_rng(2)
  windows = rng.integers(0, 50_000, (32, 5)).astype(np.int32)
  device = jax.jit(prompt_keys)(jnp.asarray(windows), jnp.full((32,), 5, jnp.int32))
  np.testing.assert_array_equal(window_keys(windows), np.asarray(device))
  assert window_keys(windows[:1]).item() == prompt_key(windows[0])
  corpus = CorpusStore(slots=1024, width=3, min_n=2, max_n=4)
  assert corpus.filled == 0 and corpus.nbytes == 1024 * (3 + 2) * 4
  # two rollouts of other prompts: "5 6 7" is followed by 8 9 10 in the first and by 11 12 in the
  # later one (which replaces it)
  corpus.record([np.array([1, 5, 6, 7, 8, 9, 10, 4])])
  corpus.record([np.array([2, 5, 6, 7, 11, 12]), np.array([3, 3, 6, 7, 8])])
  table = corpus.table()
  seq = lambda *rows: Sequences(tokens=jnp.asarray([r + [0] * (8 - len(r)) for r in rows],
                                                   jnp.int32),
                                lengths=jnp.asarray([len(r) for r in rows], jnp.int32),
                                prompt_lengths=jnp.ones((len(rows),), jnp.int32))
  drafts, matched = corpus_lookup(seq([9, 5, 6, 7], [4, 4, 6, 7], [6, 7, 8, 9], [13, 14]),
                                  table, draft_len=4)
  # row 0: the longest context held is "5 6 7" (3 tokens): the later rollout's 11 12, clamped;
  # row 1: "6 7" last appeared in the third sequence, before 8; row 2: "6 7 8 9" (4 tokens, the
  # longest order) -> 10 4; row 3: nothing held
  assert matched.tolist() == [3, 2, 4, 0]
  assert drafts[:3].tolist() == [[11, 12, 12, 12], [8, 8, 8, 8], [10, 4, 4, 4]]
  # a JSON round trip restores the table; another shape or damage is refused by name
  again = CorpusStore(slots=1024, width=3, min_n=2, max_n=4)
  again.load_json(corpus.to_json())
  for a, b in zip(jax.tree.leaves(again.table()), jax.tree.leaves(table)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(UserError, match=r"shape \[1024, 3, 2, 4\], this run's \[1024, 4, 2, 4\]"):
    CorpusStore(slots=1024, width=4, min_n=2, max_n=4).load_json(corpus.to_json())
  damaged = corpus.to_json()
  damaged["entries"][0] = ["x"]
  with pytest.raises(UserError, match=r"entry 0 .* out of bounds or not token ids"):
    again.load_json(damaged)
  # a history store with a table feeds it each row's prompt end and completion, and saves it
  store = HistoryStore(max_prompts=4, per_prompt=2, width=8, tail=2,
                       corpus=CorpusStore(slots=64, width=2, min_n=2, max_n=3))
  store.record(np.array([[7, 5, 6, 0]]), np.array([3]), np.array([[7, 8, 9]]), np.array([3]))
  assert store.corpus.filled > 0
  saved = store.to_json()
  fresh = HistoryStore(max_prompts=4, per_prompt=2, width=8, tail=2,
                       corpus=CorpusStore(slots=64, width=2, min_n=2, max_n=3))
  fresh.load_json(saved)
  assert fresh.to_json() == saved
  drafts, matched = corpus_lookup(seq([1, 5, 6]), fresh.corpus.table(), draft_len=2)
  assert matched.tolist() == [2] and drafts.tolist() == [[7, 8]]


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def ar_greedy(target):
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=STATIC)
  assert len(set(np.asarray(out.lengths).tolist())) > 3  # ragged: rows end at different steps
  return out


def filled_store(rollout, n=3, width=32):
  store = HistoryStore(max_prompts=16, per_prompt=2, width=width, tail=n)
  store.record(*jax.device_get((PROMPTS, PROMPT_LENGTHS, rollout.tokens, rollout.lengths)))
  return store


def acceptance(out) -> float:
  return AcceptanceMetrics.from_counts(out.stats).acceptance_rate


@pytest.mark.parametrize("engine", ["static", "queue"])
def test_greedy_history_drafts_keep_the_output_and_are_accepted_once_the_store_holds_it(
    target, ar_greedy, engine):
  """`queue`: 4 slots with compaction: rows prefilled into freed slots load their own entries."""
  eng = STATIC if engine == "static" else EngineConfig(queue=QueueConfig(max_rows=4,
                                                                         refill_fraction=0.25),
                                                       adaptive=AdaptiveConfig(enabled=False))
  drafter = HistoryDrafter(draft_len=3, n=3, min_n=1, min_match=2)
  rates = {}
  for name, store in (("empty", HistoryStore(16, 2, 32, 3)), ("filled", filled_store(ar_greedy))):
    out = speculative_generate(target, drafter, HistoryParams(table=store.table()), PROMPTS,
                               PROMPT_LENGTHS, jax.random.key(1), GREEDY, engine=eng)
    for field in ("tokens", "lengths", "eos", "sequences"):
      np.testing.assert_array_equal(getattr(out, field), getattr(ar_greedy, field), err_msg=field)
    rates[name] = acceptance(out)
  # the store holds this very output: (nearly) every history draft is right
  assert rates["filled"] > 0.9 and rates["filled"] > rates["empty"] + 0.2, rates


def test_an_inner_drafter_drafts_where_the_history_has_nothing(target, ar_greedy):
  inner, inner_params = DraftModelDrafter.from_model(target, 3)  # the target itself: all right
  drafter = HistoryDrafter(draft_len=3, n=3, min_match=3, inner=inner)
  assert drafter.stateful and drafter.row_local
  # the history holds other prompts' completions only: the inner drafter drafts every row
  other = HistoryStore(max_prompts=16, per_prompt=2, width=32, tail=3)
  other.record(np.asarray(PROMPTS) + 1, np.asarray(PROMPT_LENGTHS), np.asarray(ar_greedy.tokens),
               np.asarray(ar_greedy.lengths))
  out = speculative_generate(target, drafter, HistoryParams(table=other.table(),
                                                            inner=inner_params),
                             PROMPTS, PROMPT_LENGTHS, jax.random.key(1), GREEDY, engine=STATIC)
  np.testing.assert_array_equal(out.tokens, ar_greedy.tokens)
  assert acceptance(out) > 0.99
  # the history holds this output: history drafts, and on steps where every row has one the
  # inner drafter does not run (its state stays as observed); the output is the same
  out = speculative_generate(target, drafter, HistoryParams(table=filled_store(ar_greedy).table(),
                                                            inner=inner_params),
                             PROMPTS, PROMPT_LENGTHS, jax.random.key(1), GREEDY, engine=STATIC)
  np.testing.assert_array_equal(out.tokens, ar_greedy.tokens)
  assert acceptance(out) > 0.9


# -- temperature 1 ------------------------------------------------------------------------------


def test_temperature_one_hybrid_drafts_keep_the_targets_distribution(target):
  """History entries from an earlier sampled rollout (right about a quarter of the time) and a
  one-layer draft model whose drafts carry their probabilities: the verifier sees one-hot
  distributions for history drafts and the model's for its own, row by row."""
  prompts, lengths = stat_prompts()
  plain = generate(target, prompts, lengths, jax.random.key(10), SAMPLE, engine=STATIC)
  earlier = generate(target, prompts[:64], lengths[:64], jax.random.key(11), SAMPLE,
                     engine=STATIC)
  store = HistoryStore(max_prompts=4, per_prompt=4, width=12, tail=2)
  store.record(*jax.device_get((prompts[:64], lengths[:64], earlier.tokens, earlier.lengths)))
  assert store.prompts == 2
  inner, inner_params = DraftModelDrafter.from_model(truncated_copy(target, 1), 3)
  drafter = HistoryDrafter(draft_len=3, n=2, min_match=1, inner=inner)
  out = speculative_generate(target, drafter, HistoryParams(table=store.table(),
                                                            inner=inner_params),
                             prompts, lengths, jax.random.key(20), SAMPLE,
                             engine=STATIC.replace(adaptive=dict(enabled=False)))
  assert AcceptanceMetrics.from_counts(out.stats).num_accepted_tokens > ROWS // 4
  assert_same_distribution(plain, out, "hybrid")


def _prefill_step(prompts, lengths) -> TargetStep:
  """What a drafter observes of the prefill (prompt logits are not computed)."""
  empty = jnp.zeros(prompts.shape + (0,), jnp.float32)
  return TargetStep(input_tokens=prompts, next_tokens=prompts, start=jnp.zeros_like(lengths),
                    num_new=lengths, out=DecoderOutput(logits=None, hidden=empty,
                                                       aux_hidden=empty))


@pytest.mark.parametrize("broken", [False, True], ids=["verifier", "broken-residual"])
def test_temperature_one_sampled_history_drafts_keep_the_targets_distribution(target, broken,
                                                                               monkeypatch):
  """Entries that disagree (each prompt's four completions drawn from four tokens, none of them
  the target's): drafts drawn from their counts carry a spread q, which the verifier's residual
  must correct. The rollouts agree in distribution with the plain loop's; with the residual
  replaced by p (a broken verifier) the same check fails."""
  prompts, lengths = stat_prompts()
  plain = generate(target, prompts, lengths, jax.random.key(10), SAMPLE, engine=STATIC)
  store = HistoryStore(max_prompts=4, per_prompt=4, width=12, tail=2)
  rng = np.random.default_rng(3)
  completions = rng.choice(np.array([3, 7, 9, 12]), size=(8, 6))
  store.record(*jax.device_get((prompts[:8], lengths[:8])), completions, np.full(8, 6))
  assert store.prompts == 2
  drafter = HistoryDrafter(draft_len=3, n=2, min_match=1, sampled=True,
                           vocab_size=CFG.vocab_size)
  params = HistoryParams(table=store.table())
  seq = Sequences(tokens=jnp.pad(prompts[:2], ((0, 0), (0, 8))), lengths=lengths[:2],
                  prompt_lengths=lengths[:2])
  state = drafter.observe(params, drafter.init(params, 2, 16), _prefill_step(prompts[:2],
                                                                             lengths[:2]))
  _, q, _ = drafter.propose(params, state, seq, jax.random.key(0))
  assert np.all(np.asarray(jnp.max(q[:, 0], axis=-1)) < 1.0)  # the first drafts' q is spread
  engine = STATIC.replace(adaptive=dict(enabled=False))
  if broken:
    monkeypatch.setattr(segment, "verify", verify_without_residual)
    jax.clear_caches()  # the segment programs are traced again with it ...
  try:
    out = speculative_generate(target, drafter, params, prompts, lengths, jax.random.key(21),
                               SAMPLE, engine=engine)
  finally:
    if broken:
      jax.clear_caches()  # ... and no later test finds them compiled
  assert AcceptanceMetrics.from_counts(out.stats).num_accepted_tokens > ROWS // 8
  if broken:
    with pytest.raises(AssertionError, match="two samples differ"):
      assert_same_distribution(plain, out, "sampled history, broken residual")
  else:
    assert_same_distribution(plain, out, "sampled history")
