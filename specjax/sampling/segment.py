"""The device side of the rollout engine: one state for AR and speculative decoding, its prefill,
the AR step (K = 0) and the speculative step (K >= 1), and a *segment*: a `lax.while_loop` that
steps a static bucket of rows with a static draft length over a static attention window until
too few rows are live, a row needs a wider window, or an iteration budget is spent.

The engine (`specjax.sampling.engine`) chains segments on the host: compaction, windows and the
choice of K happen between them. Every array of `EngineState` has the bucket's rows on its leading axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.models.cache import KVCache
from specjax.models.paged import NO_PAGE, POOL_AXES, PagedKV
from specjax.sampling.core import SamplingConfig, is_eos, prefill
from specjax.sampling.drafter import Drafter, Sequences, TargetStep
from specjax.sampling.metrics import AcceptanceCounts
from specjax.sampling.processing import sample_token
from specjax.sampling.rejection import verify, verify_tree
from specjax.sharding.rules import K_CACHE_AXES, V_CACHE_AXES, with_logical_constraint


@struct.dataclass
class EngineState:
  seq: Sequences  # committed tokens (prompt + completion); seq.lengths = prompt + generated
  # target cache: every committed token except the last one. Dense (a max-length buffer per row)
  # or paged (rows hold pages of one shared pool: only `page_table` and `lengths` are per row)
  cache: KVCache | PagedKV
  tokens: jax.Array  # int32[b, N + Kmax + 1] completion buffer
  logprobs: jax.Array  # float32[b, N + Kmax + 1]
  lengths: jax.Array  # int32[b] completion lengths
  done: jax.Array  # bool[b]
  row_ids: jax.Array  # int32[b] the row of the caller's batch; -1 marks a padding or free slot
  slots: jax.Array  # int32[b] the row's slot in the engine's full-size state (compaction's home)
  drafter_state: Any
  counts: AcceptanceCounts  # per row, Kmax positions


def is_cache(x) -> bool:
  return isinstance(x, (KVCache, PagedKV))


def map_rows(fn, *states):
  """`fn` over every per-row array of the states (leading axis = rows). A paged cache's pool is
  shared by all rows, not per row: it is taken from the last state as it is."""
  def one(*xs):
    if isinstance(xs[-1], PagedKV):
      return xs[-1].replace(page_table=fn(*(x.page_table for x in xs)),
                            lengths=fn(*(x.lengths for x in xs)))
    return fn(*xs)

  return jax.tree.map(one, *states, is_leaf=lambda x: isinstance(x, PagedKV))


def with_window(state: EngineState, window: int) -> EngineState:
  """Every KV cache in the state (target and drafter) reads `window` positions (0: all)."""
  return jax.tree.map(lambda x: x.with_window(window) if is_cache(x) else x, state,
                      is_leaf=is_cache)


def constrain(state: EngineState, mesh) -> EngineState:
  """Pin every row-major array to the batch axes of `mesh` (caches: kv heads on tensor too), so
  each device steps its own rows and nothing is replicated."""
  if mesh is None:
    return state

  def one(x):
    if isinstance(x, PagedKV):  # the pool: pages on the batch axes, as the rows holding them
      pool = lambda a: with_logical_constraint(a, POOL_AXES, mesh)
      return x.replace(k=pool(x.k), v=pool(x.v),
                       page_table=with_logical_constraint(x.page_table, ("batch", None), mesh),
                       lengths=with_logical_constraint(x.lengths, ("batch",), mesh))
    if is_cache(x):
      k = lambda a: with_logical_constraint(a, K_CACHE_AXES, mesh)
      v = lambda a: with_logical_constraint(a, V_CACHE_AXES, mesh)
      return x.replace(k=tuple(map(k, x.k)), v=tuple(map(v, x.v)),
                       lengths=with_logical_constraint(x.lengths, ("batch",), mesh))
    return with_logical_constraint(x, ("batch",) + (None,) * (x.ndim - 1), mesh)

  return jax.tree.map(one, state, is_leaf=is_cache)


def take_rows(state: EngineState, idx: jax.Array, pad: jax.Array) -> EngineState:
  """The rows `idx` of a state (compaction); slots where `pad` is True become finished padding."""
  state = map_rows(lambda x: jnp.take(x, idx, axis=0), state)
  state = state.replace(done=state.done | pad, row_ids=jnp.where(pad, -1, state.row_ids))
  return release_pages(state, pad)


def release_pages(state: EngineState, rows: jax.Array) -> EngineState:
  """Rows (bool[b]) of a paged state lose their page-table entries (in the target's pool and a
  paged drafter cache's), so whatever a step computes for them is written nowhere (their pages
  may belong to another row now)."""
  if not isinstance(state.cache, PagedKV):
    return state
  return with_page_table(state, jnp.where(rows[:, None], NO_PAGE, state.cache.page_table))


def with_page_table(state: EngineState, table: jax.Array) -> EngineState:
  """Every paged cache of the state (the target's; the drafter's, which shares its pages) with
  page table `table`."""
  return jax.tree.map(lambda x: x.with_page_table(table) if isinstance(x, PagedKV) else x,
                      state, is_leaf=is_cache)


def paused_rows(s: EngineState, span: int) -> jax.Array:
  """bool[b]: live rows whose pages cannot hold the next step's writes (positions up to
  seq.lengths - 1 + span: K, or a draft tree's drafted nodes, `Drafter.write_span`). A paused
  row steps like the others but commits nothing (its sample is discarded, so its distribution is
  unchanged) until the host gives it pages."""
  if not isinstance(s.cache, PagedKV):
    return jnp.zeros_like(s.done)
  return ~s.done & (s.seq.lengths + span > s.cache.capacity())


def scatter(buf: jax.Array, new: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
  """buf[b, start[b] + j] = new[b, j] for j < count[b]; nothing else changes."""
  j = jnp.arange(new.shape[1])[None, :]
  idx = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])  # out of range: dropped
  return buf.at[jnp.arange(buf.shape[0])[:, None], idx].set(new.astype(buf.dtype), mode="drop")


# -- prefill ------------------------------------------------------------------------------------

def init_state(graphdef, params, drafter: Drafter | None, drafter_params, prompts, prompt_lengths,
               key, cfg: SamplingConfig, cache_size: int, max_draft_len: int,
               mesh=None, group: int = 1, target_cache_size: int = 0) -> EngineState:
  """Prefill the prompts, sample each row's first token, let the drafter see the prompts.

  `group` > 1: the rows come in consecutive blocks of `group` copies of one prompt (a GRPO group),
  so the target prefills each distinct prompt once and every row of a block gets its cache,
  hidden states and last logits; each row still samples its own first token.

  `target_cache_size` (0: `cache_size`) sizes the target's dense prefill cache: a paged engine
  prefills into a prompt-wide buffer and copies it into its pages (`engine.paged_state.to_paged`), and so
  for a drafter whose cache it pages."""
  target = nnx.merge(graphdef, params)
  batch, width = prompts.shape
  n = cfg.max_new_tokens
  target_size = target_cache_size or cache_size
  # a paged engine keeps a drafter's own KV cache on pages too (`Drafter.page_layout`)
  draft_size = target_size if drafter is not None and \
      drafter.page_layout(drafter_params) is not None else cache_size
  if group > 1:
    pre_out, cache, logits = prefill(target, prompts[::group], prompt_lengths[::group],
                                     target_size)
    pre_out, cache, logits = jax.tree.map(lambda x: jnp.repeat(x, group, axis=0),
                                          (pre_out.replace(cache=None), cache, logits))
  else:
    pre_out, cache, logits = prefill(target, prompts, prompt_lengths, target_size)
  first, first_lp = sample_token(key, logits, temperature=cfg.temperature, top_k=cfg.top_k,
                                 top_p=cfg.top_p)
  rows = jnp.arange(batch)
  seq_tokens = jnp.zeros((batch, cache_size), jnp.int32).at[:, :width].set(prompts)
  seq_tokens = seq_tokens.at[rows, prompt_lengths].set(first)
  seq = Sequences(tokens=seq_tokens, lengths=prompt_lengths + 1, prompt_lengths=prompt_lengths)
  dstate = ()
  if drafter is not None:
    shifted = jnp.concatenate([prompts[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
    next_tokens = shifted.at[rows, prompt_lengths - 1].set(first)
    dstate = drafter.init(drafter_params, batch, draft_size)
    # prompt logits are not computed (B x P x V); drafters get hidden and aux_hidden
    dstate = drafter.observe(drafter_params, dstate, TargetStep(
        input_tokens=prompts, next_tokens=next_tokens, start=jnp.zeros((batch,), jnp.int32),
        num_new=prompt_lengths, out=pre_out.replace(logits=None)))
  width_out = n + max_draft_len + 1
  state = EngineState(
      seq=seq, cache=cache,
      tokens=jnp.zeros((batch, width_out), jnp.int32).at[:, 0].set(first),
      logprobs=jnp.zeros((batch, width_out), jnp.float32).at[:, 0].set(first_lp),
      lengths=jnp.ones((batch,), jnp.int32), done=is_eos(first, cfg.eos_ids) | (n == 1),
      row_ids=rows.astype(jnp.int32), slots=rows.astype(jnp.int32), drafter_state=dstate,
      counts=AcceptanceCounts.zeros(max(max_draft_len, 1), batch))
  return constrain(state, mesh)


# -- steps --------------------------------------------------------------------------------------

def _commit(s: EngineState, cfg: SamplingConfig, emitted, emitted_lp, num_valid,
            paused) -> tuple:
  """Commit each live row's emitted window up to (and including) its first EOS, within
  max_new_tokens; `paused` rows commit nothing. Returns (commit int32[b], new lengths, new done,
  new seq)."""
  n, width = cfg.max_new_tokens, emitted.shape[1]
  pos = jnp.arange(width)[None, :]
  eos_at = jnp.where(is_eos(emitted, cfg.eos_ids) & (pos < num_valid[:, None]), pos, width)
  first_eos = jnp.min(eos_at, axis=1)
  commit = jnp.minimum(jnp.minimum(num_valid, first_eos + 1), n - s.lengths)
  commit = jnp.where(~s.done & ~paused, commit, 0).astype(jnp.int32)
  lengths = s.lengths + commit
  done = s.done | (~s.done & (first_eos < commit)) | (lengths >= n)
  seq = s.seq.replace(tokens=scatter(s.seq.tokens, emitted, s.seq.lengths, commit),
                      lengths=s.seq.lengths + commit)
  return commit, lengths, done, seq


def _last_token(seq: Sequences) -> jax.Array:
  return jnp.take_along_axis(seq.tokens, (seq.lengths - 1)[:, None], axis=1)  # [b, 1]


def ar_step(target, drafter: Drafter | None, drafter_params, cfg: SamplingConfig, key,
            s: EngineState) -> EngineState:
  """K = 0: one target forward per row, one sampled token. A stateful drafter still observes
  the step, so a later segment can draft again."""
  last = _last_token(s.seq)
  out = target(last, cache=s.cache)
  tok, lp = sample_token(key, out.logits[:, 0], temperature=cfg.temperature, top_k=cfg.top_k,
                         top_p=cfg.top_p)
  commit, lengths, done, seq = _commit(s, cfg, tok[:, None], lp[:, None],
                                       jnp.ones_like(s.lengths), paused_rows(s, 0))
  dstate = s.drafter_state
  if drafter is not None and drafter.stateful:
    dstate = drafter.observe(drafter_params, dstate, TargetStep(
        input_tokens=last, next_tokens=tok[:, None], start=s.cache.lengths, num_new=commit,
        out=out))
  return s.replace(seq=seq, cache=out.cache.advance(commit),
                   tokens=scatter(s.tokens, tok[:, None], s.lengths, commit),
                   logprobs=scatter(s.logprobs, lp[:, None], s.lengths, commit),
                   lengths=lengths, done=done, drafter_state=dstate)


def speculative_step(target, drafter: Drafter, drafter_params, cfg: SamplingConfig, key,
                     s: EngineState) -> EngineState:
  """K = drafter.draft_len >= 1: draft, one target forward over [last, drafts], verify, commit
  num_accepted + 1 tokens per row. With `drafter.tree_width` > 1 the forward scores a draft tree
  (`tree_forward`)."""
  key_draft, key_verify = jax.random.split(key)
  last = _last_token(s.seq)
  if drafter.tree_width > 1:
    res, inputs, out, dstate = tree_forward(target, drafter, drafter_params, cfg, key_draft,
                                            key_verify, s, last)
  else:
    drafts, draft_probs, dstate = drafter.propose(drafter_params, s.drafter_state, s.seq,
                                                  key_draft)
    inputs = jnp.concatenate([last, drafts.astype(jnp.int32)], axis=1)  # [b, K+1]
    out = target(inputs, cache=s.cache)
    res = verify(key_verify, out.logits, drafts, draft_probs, temperature=cfg.temperature,
                 top_k=cfg.top_k, top_p=cfg.top_p)
  paused = paused_rows(s, drafter.write_span)
  commit, lengths, done, seq = _commit(s, cfg, res.tokens, res.logprobs, res.num_accepted + 1,
                                       paused)
  dstate = drafter.observe(drafter_params, dstate, TargetStep(
      input_tokens=inputs, next_tokens=res.tokens, start=s.cache.lengths, num_new=commit,
      out=out))
  return s.replace(seq=seq, cache=out.cache.advance(commit),
                   tokens=scatter(s.tokens, res.tokens, s.lengths, commit),
                   logprobs=scatter(s.logprobs, res.logprobs, s.lengths, commit),
                   lengths=lengths, done=done, drafter_state=dstate,
                   counts=s.counts.update(res.num_accepted, ~s.done & ~paused))


def tree_forward(target, drafter: Drafter, drafter_params, cfg: SamplingConfig, key_draft,
                 key_verify, s: EngineState, last: jax.Array):
  """Draft a tree (`Drafter.propose_tree`), score its nodes in one target forward, verify it
  (`rejection.verify_tree`) and keep the accepted path's cache entries where a chain's would be.
  Returns (result, the path's input tokens [b, K+1], the forward's output on the path (its
  logits, hidden and aux_hidden gathered to path order, as the drafter observes a chain), the
  drafter state)."""
  drafts, draft_probs, alternatives, dstate = drafter.propose_tree(
      drafter_params, s.drafter_state, s.seq, key_draft)
  tree = drafter.tree
  b = drafts.shape[0]
  alternatives = alternatives[:, :tree.alt_depths]  # the depths that carry alternatives
  nodes = jnp.concatenate([last, drafts.astype(jnp.int32),
                           alternatives.reshape(b, -1).astype(jnp.int32)], axis=1)
  out = target(nodes, cache=s.cache, tree=tree)
  res, path = verify_tree(key_verify, out.logits, drafts, draft_probs, alternatives,
                          temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
  along = lambda x: jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)),
                                        axis=1)
  out = out.replace(logits=along(out.logits), hidden=along(out.hidden),
                    aux_hidden=along(out.aux_hidden),
                    cache=out.cache.keep_path(path, tree.nodes))
  return res, along(nodes), out, dstate


# -- a segment ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SegmentSpec:
  """The static part of a segment program (one compiled program per distinct spec, and per
  drafter: K is the drafter's `draft_len`, the one place it is set)."""

  cfg: SamplingConfig
  drafts: bool  # speculative steps at the drafter's K; False: AR steps (K = 0)
  window: int  # cache positions attention reads; 0 = the whole cache


def committed(before: EngineState, after: EngineState, commit: jax.Array) -> EngineState:
  """`after` (a state stepped from `before`) where `commit` is True; else `before` with the KV
  buffers (target and drafter) of `after`: what the steps wrote there lies at or past each row's
  committed length in `before`, which no query sees and later steps overwrite, so that state is
  `before` as far as any step can tell, and its caches need no copy."""
  pick = lambda a, b: jnp.where(commit, a, b)

  def one(b, a):
    if isinstance(b, PagedKV):
      return a.replace(lengths=pick(a.lengths, b.lengths),
                       page_table=pick(a.page_table, b.page_table))
    if isinstance(b, KVCache):
      return a.replace(lengths=pick(a.lengths, b.lengths))
    return pick(a, b)

  return jax.tree.map(one, before, after, is_leaf=is_cache)


def run_segment(graphdef, params, drafter: Drafter | None, drafter_params, key, state, max_iters,
                stop_at_live, spec: SegmentSpec, mesh=None, stop_at_paused=1,
                commit=True) -> tuple[EngineState, jax.Array]:
  """Step until every row is done, live rows <= `stop_at_live`, a live row would write past the
  window, `max_iters` steps ran, or (paged) `stop_at_paused` live rows, or all of them, wait for
  pages. Returns (state, steps run). `commit` (traced: one program either way) False: a dry run,
  which returns `state` as it was (`committed`) in its own buffers: the engine times steps so
  without a copy of its state."""
  target = nnx.merge(graphdef, params)
  if spec.drafts and drafter is None:
    raise ValueError("run_segment: a drafting segment (spec.drafts) needs a drafter")
  k, window = drafter.draft_len if spec.drafts else 0, spec.window
  span = drafter.write_span if k > 0 else 0  # positions a step writes past a row's last token
  step = ar_step if k == 0 else speculative_step

  def cond(carry):
    it, s = carry
    live = ~s.done
    ok = (it < max_iters) & (jnp.sum(live) > stop_at_live)
    if isinstance(s.cache, PagedKV):
      paused = jnp.sum(paused_rows(s, span))
      ok &= (paused < jnp.maximum(stop_at_paused, 1)) & (paused < jnp.sum(live))
    if window:  # a step writes cache positions up to seq.lengths - 1 + K (a tree: its nodes)
      longest = jnp.max(jnp.where(live, s.seq.lengths, 0))
      ok &= longest + span <= window
    return ok

  def body(carry):
    it, s = carry
    s = step(target, drafter, drafter_params, spec.cfg, jax.random.fold_in(key, it), s)
    return it + 1, constrain(s, mesh)

  state = with_window(constrain(state, mesh), window)
  iters, stepped = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
  return with_window(committed(state, stepped, commit), 0), iters
