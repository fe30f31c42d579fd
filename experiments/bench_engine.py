"""Rollout-engine benchmark on an RL-shaped workload: static loop vs live-batch compaction vs
adaptive speculation, three drafters, plus a no-acceptance control.

  python experiments/bench_engine.py --quick            # draft model + EAGLE-3, one batch size
  python experiments/bench_engine.py --quick --no-accept
  python experiments/bench_engine.py                    # + n-gram, sweeps the batch size

Workload: P prompts x G samples (GRPO groups), temperature 1, a 25.7M-parameter target (hidden 512,
8 layers, vocab 512: memory-bound decode at a small live batch on a CPU) whose next-token
distribution is learnable (`--target markov`): a synthetic language (a first-order Markov chain,
each token followed by one of 4 tokens with probabilities 0.7/0.15/0.1/0.05, entropy 0.91 nats);
the target's embedding dominates its residual stream (x25), its layers add a smaller
context-dependent part (output projections x0.25), and its LM head is trained on the language
(cross-entropy against the language's own next-token distribution, body frozen): a language model
whose samples follow the language. Prompts come from the same language. `--target random` keeps
an all-random target (no drafter learns it: its next token depends on the whole random context).
The end-of-sequence set is chosen from the target's own samples so that completion lengths are
long-tailed (10th/50th/90th percentile near 10/25/100% of max_new_tokens), as in RL.

Drafters: `draft_model` (a truncated copy of the target: its first --draft-layers layers with the
shared embedding and head), `eagle3` (an EAGLE-3 head with a reduced draft vocabulary, trained
offline on the target's rollouts by the TTT loss), `ngram` (prompt lookup). Arms (same prompts and
keys): ar_static (the plain full-batch loop), ar_compact (live-batch compaction), then per drafter
<d>_static (fixed K=3, full batch, the plain loop) and <d>_adaptive (compaction + K chosen per
bucket); the first drafter's arms are named spec_static / spec_adaptive. Every arm prefills each
distinct prompt once, the engine's default for GRPO groups (--no-share-prefill: all G copies,
the engine before it shared). --no-accept adds a random target (init std 0.02, near-uniform)
whose n-gram drafts are never accepted, at batch 1, 8, 32: adaptivity must cost nothing there; at
batch 1 it also times AR's decode loop against two roofs, a 512 MB read and a bare chain of the
target's own matrix-vector products, in turn within each round (the machine's bandwidth drifts by
up to 2x between minutes). Every arm runs once untimed (compiles, calibrates: all buckets ahead,
as RL rollouts do, so no timed run compiles), then --repeats rounds in which each arm runs once
in turn (interleaved: a drift in the machine's speed hits every arm alike); medians, and paired
per-round ratios. Prints tables, writes JSON. Asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from specjax.drafters import (DraftModelDrafter, DraftTrainConfig, NgramDrafter,  # noqa: E402
                              eagle3_drafter, train_draft_head, truncated_copy)
from specjax.errors import UserError  # noqa: E402
from specjax.jobs import run_main  # noqa: E402
from specjax.models import Decoder, ModelConfig  # noqa: E402
from specjax.sampling import (STATIC, AcceptanceMetrics, EngineConfig, EngineTuning,  # noqa: E402
                              SamplingConfig, generate, speculative_generate)
from specjax.sampling.engine_config import AdaptiveConfig, CompileConfig, QueueConfig  # noqa: E402
from specjax.sampling import engine as eng  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--quick", action="store_true", help="one batch size, fewer repeats")
  m = p.add_argument_group("target")
  m.add_argument("--target", choices=["markov", "random"], default="markov",
                 help="markov: LM head trained on a synthetic Markov language; random: all random")
  m.add_argument("--head-fit-steps", type=int, default=200,
                 help="markov: Adam steps of the LM head on the language")
  m.add_argument("--embed-scale", type=float, default=25.0,
                 help="markov: the embedding's scale over init (the token dominates the state)")
  m.add_argument("--layer-scale", type=float, default=0.25,
                 help="markov: scale of each layer's output projections (attention, MLP)")
  m.add_argument("--hidden", type=int, default=512)
  m.add_argument("--layers", type=int, default=8)
  m.add_argument("--heads", type=int, default=8)
  m.add_argument("--kv-heads", type=int, default=4)
  m.add_argument("--head-dim", type=int, default=64)
  m.add_argument("--vocab", type=int, default=512)
  m.add_argument("--init-std", type=float, default=0.02)
  w = p.add_argument_group("workload")
  w.add_argument("--prompts", type=int, default=2, help="prompts per batch")
  w.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
  w.add_argument("--batch-sweep", type=int, nargs="+", default=[8, 16, 32],
                 help="full mode: batch sizes (prompts x G)")
  w.add_argument("--prompt-len", type=int, default=32)
  w.add_argument("--max-new", type=int, default=128)
  w.add_argument("--temperature", type=float, default=1.0)
  w.add_argument("--median-frac", type=float, default=0.25,
                 help="target median completion length / max_new (EOS set chosen to match)")
  d = p.add_argument_group("drafters")
  d.add_argument("--static-k", type=int, default=3)
  d.add_argument("--max-draft-len", type=int, default=6,
                 help="largest K the adaptive arms may pick (at 4 the draft model's acceptance "
                      "length was 4.4-4.7 of 5: the ceiling, not the drafter, stopped it)")
  d.add_argument("--draft-vocab", type=int, default=256)
  d.add_argument("--eagle-steps", type=int, default=80)
  d.add_argument("--eagle-lr", type=float, default=5e-3)
  d.add_argument("--drafters", nargs="+", default=["draft_model", "eagle3", "ngram"],
                 choices=["draft_model", "eagle3", "ngram"],
                 help="the first one's arms are named spec_*, the others' <drafter>_*")
  d.add_argument("--draft-layers", type=int, default=1,
                 help="draft_model: layers of the truncated copy of the target")
  p.add_argument("--no-share-prefill", action="store_true",
                 help="every arm prefills each of the G copies of a prompt (the default prefills "
                      "each distinct prompt once)")
  p.add_argument("--no-accept", action="store_true", help="add the no-acceptance control")
  p.add_argument("--no-accept-only", action="store_true", help="run the control alone")
  p.add_argument("--no-accept-batches", type=int, nargs="+", default=[1, 8, 32])
  p.add_argument("--repeats", type=int, default=7,
                 help="timed runs per arm (--quick: at most 5); each run samples new completions, "
                      "so a run's length, and its time, varies with the longest row")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/bench_engine.json")
  a = p.parse_args(argv)
  if a.quick:
    a.repeats = min(a.repeats, 5)
    a.eagle_steps = min(a.eagle_steps, 30)
    if "--drafters" not in (argv if argv is not None else sys.argv):
      a.drafters = ["draft_model", "eagle3"]
  return a


def model_config(a, init_std: float) -> ModelConfig:
  return ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                     num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                     mlp_hidden=3 * a.hidden, tie_embeddings=False, init_std=init_std)


BRANCH_PROBS = np.array([0.7, 0.15, 0.1, 0.05])


class MarkovLanguage:
  """Token t + 1 is one of 4 successors of token t (ids >= 3), drawn with BRANCH_PROBS."""

  def __init__(self, vocab: int, seed: int):
    rng = np.random.default_rng(seed + 7)
    n = len(BRANCH_PROBS)
    self.successors = np.stack([rng.choice(vocab - 3, n, replace=False) + 3
                                for _ in range(vocab)])
    self.vocab = vocab

  @property
  def entropy(self) -> float:
    return float(-(BRANCH_PROBS * np.log(BRANCH_PROBS)).sum())

  def transition(self) -> np.ndarray:
    """float32[V, V]: P(next | current)."""
    p = np.zeros((self.vocab, self.vocab), np.float32)
    np.put_along_axis(p, self.successors, BRANCH_PROBS[None].astype(np.float32), axis=1)
    return p

  def sample(self, rng, n: int, length: int) -> np.ndarray:
    x = np.zeros((n, length), np.int64)
    x[:, 0] = rng.integers(3, self.vocab, n)
    for t in range(1, length):
      x[:, t] = self.successors[x[:, t - 1], rng.choice(len(BRANCH_PROBS), n, p=BRANCH_PROBS)]
    return x


def fit_head(target, language: MarkovLanguage, rng, steps: int, log) -> float:
  """Train the target's LM head on the language (cross-entropy on the frozen body's final
  states, Adam); returns the final training loss (nats/token)."""
  data = jnp.asarray(language.sample(rng, 128, 128), jnp.int32)
  feats = jax.jit(lambda m, x: m.final_norm(m(x, compute_logits=False).hidden))(target, data)
  x = feats.reshape(-1, feats.shape[-1])
  # soft labels: the language's own next-token distribution (sampled labels would let the head
  # memorise the sample through the context and drift from the language)
  y = jnp.asarray(language.transition()[np.asarray(data).reshape(-1)])
  opt = optax.adam(1e-2)

  @jax.jit
  def step(w, state):
    loss, g = jax.value_and_grad(
        lambda w: optax.softmax_cross_entropy(x @ w, y).mean())(w)
    updates, state = opt.update(g, state)
    return optax.apply_updates(w, updates), state, loss

  w = target.lm_head[...]
  state = opt.init(w)
  for _ in range(steps):
    w, state, loss = step(w, state)
  target.lm_head[...] = w
  log(f"LM head fitted to the language: {float(loss):.3f} nats/token after {steps} steps "
      f"(the language's entropy: {language.entropy:.3f})")
  return float(loss)


def markov_target(a, log):
  """The Markov-language target at `a`'s shape and seed (sets `a.language`): the embedding scaled
  by `a.embed_scale`, each layer's output projections by `a.layer_scale`, the LM head fitted to
  the language, then an EOS set for long-tailed lengths. Returns (target, its ModelConfig, the
  rng that drew the head's data and the EOS sample, EOS ids, the length quantiles / max_new)."""
  cfg_m = model_config(a, a.init_std)
  target = Decoder(cfg_m, rngs=nnx.Rngs(a.seed))
  rng = np.random.default_rng(a.seed)
  a.language = MarkovLanguage(a.vocab, a.seed)
  target.embed[...] = target.embed[...] * a.embed_scale
  for layer in target.layers:
    layer.attn.o_proj[...] = layer.attn.o_proj[...] * a.layer_scale
    layer.mlp.down[...] = layer.mlp.down[...] * a.layer_scale
  fit_head(target, a.language, rng, a.head_fit_steps, log)
  eos, quantiles = choose_eos(a, target, rng)
  return target, cfg_m, rng, eos, quantiles


def make_prompts(a, rng, n_prompts: int) -> tuple[jax.Array, jax.Array]:
  """n_prompts ragged prompts (from the language for a markov target, else random tokens), each
  repeated G times (consecutive rows, as in GRPO)."""
  toks = (a.language.sample(rng, n_prompts, a.prompt_len) if a.language is not None
          else rng.integers(3, a.vocab, (n_prompts, a.prompt_len)))
  lens = rng.integers(a.prompt_len // 2, a.prompt_len + 1, n_prompts)
  toks = np.where(np.arange(a.prompt_len)[None] < lens[:, None], toks, 0)
  return (jnp.asarray(np.repeat(toks, a.group, 0), jnp.int32),
          jnp.asarray(np.repeat(lens, a.group, 0), jnp.int32))


def choose_eos(a, target, rng) -> tuple[tuple[int, ...], dict]:
  """The EOS set: frequent tokens of the target's own samples, added until the median
  completion would end at median_frac * max_new (rows that never emit one run to the limit)."""
  prompts, lens = make_prompts(a, rng, 16)
  cfg = SamplingConfig(max_new_tokens=a.max_new, temperature=a.temperature)
  out = generate(target, prompts, lens, jax.random.key(a.seed + 99), cfg, engine=STATIC)
  toks = np.asarray(out.tokens)
  n = a.max_new
  first = np.full((toks.shape[0], a.vocab), n, np.int64)  # first position of each token + 1
  for r in range(toks.shape[0]):
    for t in range(n - 1, -1, -1):
      first[r, toks[r, t]] = t + 1
  order = np.argsort(-np.bincount(toks.ravel(), minlength=a.vocab))[:256]
  eos, lengths, goal = [], np.full(toks.shape[0], n), a.median_frac * n
  while np.median(lengths) > goal and len(eos) < len(order):
    # the token whose addition brings the median closest to the goal (rarer tokens end fewer rows)
    gap = [abs(np.median(np.minimum(lengths, first[:, t])) - goal) if t not in eos else np.inf
           for t in order]
    tok = int(order[int(np.argmin(gap))])
    eos.append(tok)
    lengths = np.minimum(lengths, first[:, tok])
  q = {f"p{p}": float(np.percentile(lengths, p) / n) for p in (10, 50, 90)}
  return tuple(eos), q


def interleaved_runs(arms: dict, repeats: int) -> dict:
  """Every arm once untimed (compiles, calibrates), then `repeats` rounds that time each arm once
  in turn: a change in the machine's speed during the benchmark lands on every arm alike, and the
  rounds pair the arms' times. Returns {arm: (seconds per round, last rollout, programs compiled
  during its timed runs, tokens per round, seconds of the first call)}: the first call compiles
  (and, adaptive, calibrates) every program the arm needs, so it is what a run waits for before
  its first rollout; an arm after the first reuses the programs the arms share (the prefill)."""
  first = {}
  for name, fn in arms.items():
    t0 = time.perf_counter()
    jax.block_until_ready(fn(0).tokens)
    first[name] = time.perf_counter() - t0
  runs = {name: ([], None, 0, [], first[name]) for name in arms}
  for i in range(repeats):
    for name, fn in arms.items():
      times, _, compiled, tokens, _ = runs[name]
      before = eng.compiled_programs()
      t0 = time.perf_counter()
      out = fn(i + 1)
      jax.block_until_ready(out.tokens)
      times.append(time.perf_counter() - t0)
      tokens.append(int(np.asarray(out.lengths).sum()))
      runs[name] = (times, out, compiled + eng.compiled_programs() - before, tokens, first[name])
  return runs


def paired_ratio(base: dict, arm: dict) -> float:
  """Median over rounds of base time / arm time (`interleaved_runs` pairs them by round)."""
  return statistics.median(b / x for b, x in zip(base["rollout_s_all"], arm["rollout_s_all"]))


def arm_record(times, out, compiled, tokens, first_call_s) -> dict:
  """Rollout seconds (median) and tokens/s over all timed runs: arms sample different (equally
  distributed) completions, so a run's length varies; tokens/s is the steadier figure."""
  rec = {"rollout_s": statistics.median(times), "rollout_s_all": times,
         "first_call_s": first_call_s,
         "tokens": tokens[-1], "tokens_all": tokens,
         "tokens_per_s": sum(tokens) / sum(times), "forward_steps": int(out.num_steps),
         "compiled_in_timed_runs": compiled, "acceptance_length": 1.0}
  if out.stats is not None:
    m = AcceptanceMetrics.from_counts(out.stats)
    if m.num_drafts:
      rec["acceptance_length"] = m.acceptance_length
  ks = collections.defaultdict(collections.Counter)
  for s in out.segments:
    ks[s.bucket][s.draft_len] += s.iterations
  rec["k_per_bucket"] = {str(b): c.most_common(1)[0][0] for b, c in sorted(ks.items())}
  rec["segments"] = [{"bucket": s.bucket, "draft_len": s.draft_len,
                      "tree_width": s.tree_width, "window": s.window,
                      "iterations": s.iterations, "live_rows_start": s.live_rows_start,
                      "seconds": s.seconds, "tokens": s.tokens,
                      "expected_tokens_per_s": s.expected_tokens_per_s} for s in out.segments]
  return rec


def run_arms(a, target, drafters: dict, prompts, lens, cfg: SamplingConfig,
             log) -> tuple[dict, list]:
  """({arm: record}, the adaptive arms' calibration rows). Each adaptive arm owns its
  `EngineTuning`, so no arm reuses another's measured costs or acceptance estimates."""
  key = lambda i: jax.random.key(a.seed * 1000 + i)
  tunings = []
  queue = QueueConfig(share_prefill=not a.no_share_prefill)
  # every bucket compiled (and timed) before the first segment, as RL rollouts do, so that no
  # timed run compiles a bucket the untimed one did not reach
  ahead = dict(queue=queue, compile=CompileConfig(ahead=True))
  static = dataclasses.replace(STATIC, queue=queue)
  arms = {
      "ar_static": lambda i: generate(target, prompts, lens, key(i), cfg, engine=static),
      "ar_compact": lambda i: generate(target, prompts, lens, key(i), cfg,
                                       engine=EngineConfig(adaptive=AdaptiveConfig(enabled=False),
                                                           **ahead)),
  }
  for name, (drafter, params) in drafters.items():
    prefix = "spec" if name == a.drafters[0] else name
    tunings.append(EngineTuning())
    arms[f"{prefix}_static"] = lambda i, d=drafter, p=params: speculative_generate(
        target, d, p, prompts, lens, key(i), cfg, draft_len=a.static_k, engine=static)
    arms[f"{prefix}_adaptive"] = lambda i, d=drafter, p=params, t=tunings[-1]: \
        speculative_generate(target, d, p, prompts, lens, key(i), cfg, draft_len=a.max_draft_len,
                             engine=EngineConfig(
                                 adaptive=AdaptiveConfig(max_draft_len=a.max_draft_len), **ahead),
                             tuning=t)
  t0 = time.perf_counter()
  out = {name: arm_record(*run) for name, run in interleaved_runs(arms, a.repeats).items()}
  for name, rec in out.items():
    log(f"  {name:18s} {rec['rollout_s']:7.3f} s  {rec['tokens_per_s']:7.1f} tok/s  "
        f"acc.len {rec['acceptance_length']:.2f}  K/bucket {rec['k_per_bucket']}  "
        f"first call {rec['first_call_s']:.1f} s")
  log(f"  ({len(arms)} arms x (1 untimed + {a.repeats} timed runs, interleaved) in "
      f"{time.perf_counter() - t0:.0f} s)")
  return out, [row for t in tunings for row in t.calibration_table()]


def read_roof():
  """A compiled read of a 512 MB array (a jitted sum): () -> seconds, bytes. The machine's memory
  roof for one large stream."""
  x = jnp.ones((128 * 1024 * 1024,), jnp.float32)
  f = jax.jit(jnp.sum)
  jax.block_until_ready(f(x))
  return lambda: timed(lambda: jax.block_until_ready(f(x))), x.nbytes


def weight_chain(params, rows: int = 1, steps: int = 32):
  """A bare chain of `rows`-row products over every weight matrix in `params` (a decoder's
  parameter state) in a compiled loop: () -> seconds per pass, bytes. Each matrix is read as the
  decoder multiplies by it (`_as_product`): the tied embedding as the LM head (an untied one is
  left out: a step gathers its rows), o_proj's heads and head dim as its input, every other
  matrix's first axis as its input. The speed XLA's CPU
  kernels read these shapes at, with no attention, sampling or cache work: a decode step of
  `rows` rows cannot beat it without other kernels or another weight layout."""
  leaves = [(jax.tree_util.keystr(path), w)
            for path, w in jax.tree_util.tree_leaves_with_path(params)
            if w.ndim >= 2 and jnp.issubdtype(w.dtype, jnp.floating)]
  tied = not any("lm_head" in path for path, _ in leaves)
  # an untied embedding is gathered (a few rows per step), not multiplied by
  mats = [_as_product(path, w) for path, w in leaves if tied or "embed" not in path]
  flags = [t for _, t in mats]  # True: [out, in], contracted over its second axis
  mats = [m for m, _ in mats]
  width = max(m.shape[1 if t else 0] for m, t in zip(mats, flags))

  def chain(mats):
    def step(_, h):
      for m, t in zip(mats, flags):
        y = jnp.einsum("ri,oi->ro" if t else "ri,io->ro", h[:, : m.shape[1 if t else 0]], m)
        h = h + 1e-6 * jnp.sum(y, axis=1, keepdims=True)
      return h
    return jax.lax.fori_loop(0, steps, step, jnp.ones((rows, width), jnp.float32))

  f = jax.jit(chain)
  jax.block_until_ready(f(mats))
  return (lambda: timed(lambda: jax.block_until_ready(f(mats))) / steps,
          sum(m.nbytes for m in mats))


def _as_product(path: str, w) -> tuple:
  """(matrix, transposed) for a decoder weight at `path`: the embedding [V, D] is read as the
  tied LM head (h E^T: transposed), o_proj [H, Dh, D] as [H * Dh, D], the rest as [first axis,
  the others]."""
  if "embed" in path:
    return w.reshape(w.shape[0], -1), True
  if "o_proj" in path:
    return w.reshape(-1, w.shape[-1]), False
  return w.reshape(w.shape[0], -1), False


def matvec_roof(target, steps: int = 32):
  """`weight_chain` at one row over the target's own weights: AR decode at batch 1 cannot beat it
  without other kernels or a fused weight layout."""
  return weight_chain(nnx.state(target, nnx.Param), 1, steps)


def bandwidth_rounds(target, ar, weight_bytes: int, rounds: int) -> dict:
  """AR decode at batch 1 against the two roofs, measured in turn in each round (the machine's
  speed drifts between minutes; a ratio within one round does not see it). AR's figure is its
  decode loop alone: the segment's seconds per step, without prefill and host work. Each roof is
  the best of 3 in its round. Reports the medians over rounds of each figure and each ratio."""
  read, read_bytes = read_roof()
  chain, chain_bytes = matvec_roof(target)
  per = collections.defaultdict(list)
  for i in range(rounds):
    out = ar(100 + i)
    jax.block_until_ready(out.tokens)
    step_s = sum(s.seconds for s in out.segments) / sum(s.iterations for s in out.segments)
    per["ar_gb_s"].append(weight_bytes / step_s / 1e9)
    per["s_per_token"].append(step_s)
    per["read_gb_s"].append(read_bytes / min(read() for _ in range(3)) / 1e9)
    per["matvec_gb_s"].append(chain_bytes / min(chain() for _ in range(3)) / 1e9)
    per["fraction_of_read_bw"].append(per["ar_gb_s"][-1] / per["read_gb_s"][-1])
    per["fraction_of_matvec_roof"].append(per["ar_gb_s"][-1] / per["matvec_gb_s"][-1])
  out = {k: statistics.median(v) for k, v in per.items()}
  out["rounds"] = dict(per)
  return out


def machine() -> str:
  return f"{platform.machine()} CPU, {os.cpu_count()} cores, jax {jax.__version__}"


def command(argv) -> str:
  return "python experiments/bench_engine.py " + " ".join(sys.argv[1:] if argv is None else argv)


def timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def no_accept(a, log) -> dict:
  """A near-uniform target (init std 0.02): n-gram drafts are essentially never accepted."""
  cfg_m = model_config(a, 0.02)
  target = Decoder(cfg_m, rngs=nnx.Rngs(a.seed + 1))
  rng = np.random.default_rng(a.seed + 1)
  cfg = SamplingConfig(max_new_tokens=a.max_new // 2, temperature=a.temperature)
  out = {}
  for b in a.no_accept_batches:
    toks = jnp.asarray(rng.integers(3, a.vocab, (b, a.prompt_len)), jnp.int32)
    lens = jnp.full((b,), a.prompt_len, jnp.int32)
    key = lambda i: jax.random.key(i)
    drafter = NgramDrafter(draft_len=a.static_k, n=3)
    arms = {
        "ar": lambda i: generate(target, toks, lens, key(i), cfg, engine=STATIC),
        "spec_static": lambda i: speculative_generate(target, drafter, (), toks, lens, key(i), cfg,
                                                      engine=STATIC),
        "spec_adaptive": lambda i, t=EngineTuning(): speculative_generate(
            target, drafter, (), toks, lens, key(i), cfg, draft_len=a.max_draft_len,
            engine=EngineConfig(adaptive=AdaptiveConfig(max_draft_len=a.max_draft_len),
                                compile=CompileConfig(ahead=True)), tuning=t),
    }
    rows = {name: arm_record(*run) for name, run in interleaved_runs(arms, a.repeats).items()}
    for name, rec in rows.items():
      rec["vs_ar"] = rec["rollout_s"] / rows["ar"]["rollout_s"]
      # the same rollout length in every arm and round (no EOS): the per-round ratio is exact
      # work for work, and its median is the steadier figure under a drifting machine
      rec["vs_ar_paired"] = paired_ratio(rec, rows["ar"])  # median of arm / AR by round
      log(f"  no-accept batch {b:3d} {name:14s} {rec['rollout_s']:7.3f} s  "
          f"x{rec['vs_ar']:.2f} of AR (paired x{rec['vs_ar_paired']:.2f})  "
          f"acc.len {rec['acceptance_length']:.2f}")
    out[str(b)] = rows
  result = {"batches": out, "target_params": cfg_m.num_params()}
  if 1 in a.no_accept_batches:
    toks = jnp.asarray(rng.integers(3, a.vocab, (1, a.prompt_len)), jnp.int32)
    lens = jnp.full((1,), a.prompt_len, jnp.int32)
    ar = lambda i: generate(target, toks, lens, jax.random.key(i), cfg, engine=STATIC)
    result["ar_batch1"] = bandwidth_rounds(target, ar, cfg_m.num_params() * 4, a.repeats)
  return result


def main(argv=None) -> dict:
  a = parse_args(argv)
  log = lambda s: print(s, flush=True)
  t_start = time.perf_counter()
  if a.no_accept_only:
    summary = {"machine": machine(), "command": command(argv)}
    summary.update(control(a, log))
    finish(a, summary, t_start, log)
    return summary
  cfg_m = model_config(a, a.init_std)
  target = Decoder(cfg_m, rngs=nnx.Rngs(a.seed))
  rng = np.random.default_rng(a.seed)
  log(f"target: {cfg_m.num_params() / 1e6:.1f}M parameters, float32, {a.target}")
  a.language, head_fit = None, None
  t0 = time.perf_counter()
  if a.target == "markov":
    if cfg_m.tie_embeddings:
      raise UserError("--target markov fits an untied LM head")
    a.language = MarkovLanguage(a.vocab, a.seed)
    # the token's embedding dominates the residual stream and each layer adds a smaller,
    # context-dependent part: a language model whose next token mostly follows the language
    target.embed[...] = target.embed[...] * a.embed_scale
    for layer in target.layers:
      layer.attn.o_proj[...] = layer.attn.o_proj[...] * a.layer_scale
      layer.mlp.down[...] = layer.mlp.down[...] * a.layer_scale
    head_fit = fit_head(target, a.language, rng, a.head_fit_steps, log)
  fit_s = time.perf_counter() - t0
  eos, quantiles = choose_eos(a, target, rng)
  cfg = SamplingConfig(max_new_tokens=a.max_new, temperature=a.temperature, eos_ids=eos)
  log(f"EOS set of {len(eos)} tokens; completion length quantiles / max_new (choice sample): "
      f"{quantiles}")
  drafters = {}
  train_s = 0.0
  if "eagle3" in a.drafters:
    t0 = time.perf_counter()
    p_train, l_train = make_prompts(a, rng, 32)
    result = train_draft_head(target, p_train, l_train, sampling=cfg, progress=False,
                              config=DraftTrainConfig(steps=a.eagle_steps, batch_size=16,
                                                      lr=a.eagle_lr,
                                                      draft_vocab=min(a.draft_vocab, a.vocab),
                                                      seed=a.seed,
                                                      warmup_steps=10, rollout_batch=64))
    train_s = time.perf_counter() - t0
    embed = nnx.split(target)[1]["embed"][...]
    drafters["eagle3"] = eagle3_drafter(result.head, embed, result.maps, draft_len=a.static_k,
                                        temperature=a.temperature)
    log(f"EAGLE-3 head: {a.eagle_steps} TTT steps in {train_s:.0f} s, step-0 top-1 agreement "
        f"{result.history[-1].get('acc_0', float('nan')):.2f}")
  if "ngram" in a.drafters:
    drafters["ngram"] = (NgramDrafter(draft_len=a.static_k, n=3), ())
  if "draft_model" in a.drafters:
    drafters["draft_model"] = DraftModelDrafter.from_model(truncated_copy(target, a.draft_layers),
                                                           draft_len=a.static_k)
  drafters = {name: drafters[name] for name in a.drafters}  # the first one is "spec"
  batches = [a.prompts * a.group] if a.quick else a.batch_sweep
  results = {}
  for b in batches:
    prompts, lens = make_prompts(a, rng, b // a.group)
    log(f"batch {b} ({b // a.group} prompts x G={a.group}), max_new {a.max_new}:")
    arms, calibration = run_arms(a, target, drafters, prompts, lens, cfg, log)
    results[str(b)] = {"arms": arms, "calibration": calibration, "batch": b}
  main_b = str(batches[0])
  summary = {
      "machine": machine(),
      "command": command(argv),
      "config": {"hidden": a.hidden, "layers": a.layers, "heads": a.heads,
                 "kv_heads": a.kv_heads, "head_dim": a.head_dim, "vocab": a.vocab,
                 "batch": int(main_b), "max_new": a.max_new, "prompt_len": a.prompt_len,
                 "temperature": a.temperature, "max_draft_len": a.max_draft_len,
                 "static_k": a.static_k, "length_quantiles": quantiles, "eos_ids": list(eos),
                 "group": a.group, "draft_vocab": a.draft_vocab,
                 "share_prefill": not a.no_share_prefill,
                 "draft_layers": a.draft_layers, "drafters": a.drafters},
      "target_params": cfg_m.num_params(),
      "target": a.target,
      "head_fit": {"loss": head_fit, "language_entropy": None if a.language is None
                   else a.language.entropy, "seconds": fit_s},
      "eagle_train_s": train_s,
      "arms": results[main_b]["arms"],
      "calibration": {"rows": results[main_b]["calibration"], "drafter": "+".join(a.drafters)},
      "batches": results,
  }
  arms = summary["arms"]
  ratios = {}
  for spec in arms:
    if not spec.startswith("ar_"):
      ratios[f"{spec}_vs_ar_static"] = arms["ar_static"]["rollout_s"] / arms[spec]["rollout_s"]
      ratios[f"{spec}_vs_ar_compact"] = arms["ar_compact"]["rollout_s"] / arms[spec]["rollout_s"]
      for base in ("ar_static", "ar_compact"):  # per round, then the median
        ratios[f"{spec}_vs_{base}_paired"] = paired_ratio(arms[base], arms[spec])
  ratios["ar_compact_vs_ar_static"] = arms["ar_static"]["rollout_s"] / arms["ar_compact"]["rollout_s"]
  for name in arms:  # the same comparisons in tokens/s over all timed runs
    if name != "ar_static":
      for base in ("ar_static", "ar_compact"):
        if name != base:
          ratios[f"{name}_vs_{base}_tokens_per_s"] = (arms[name]["tokens_per_s"]
                                                      / arms[base]["tokens_per_s"])
  summary["speedups"] = ratios
  summary["main_wall_s"] = time.perf_counter() - t_start
  if a.no_accept:
    summary.update(control(a, log))
  finish(a, summary, t_start, log)
  return summary


def control(a, log) -> dict:
  """The no-acceptance control and AR at batch 1 against the machine's read bandwidth."""
  log("no-acceptance control:")
  out = {"no_accept": no_accept(a, log)}
  if "ar_batch1" in out["no_accept"]:
    out["ar_batch1"] = out["no_accept"].pop("ar_batch1")
  return out


def finish(a, summary: dict, t_start: float, log) -> None:
  summary["wall_s"] = time.perf_counter() - t_start
  summary.setdefault("main_wall_s", 0.0)
  print_table(summary)
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  tmp = a.out + ".tmp"
  with open(tmp, "w") as f:
    json.dump(summary, f, indent=1, default=float)
  os.replace(tmp, a.out)
  log(f"wrote {a.out} ({summary['wall_s']:.0f} s; without the no-acceptance control "
      f"{summary['main_wall_s']:.0f} s)")


def print_table(s: dict) -> None:
  if "batches" in s:
    print(f"\n{s['target_params'] / 1e6:.1f}M-parameter target, {s['machine']}")
  for b, r in s.get("batches", {}).items():
    base = r["arms"]["ar_static"]["rollout_s"]
    tps = r["arms"]["ar_static"]["tokens_per_s"]
    print(f"\nbatch {b}: arm               rollout_s  x ar_static  tok/s  x ar_static  acc.len  "
          "K per bucket")
    for name, rec in r["arms"].items():
      print(f"  {name:22s} {rec['rollout_s']:9.3f}  {base / rec['rollout_s']:10.2f}  "
            f"{rec['tokens_per_s']:6.1f}  {rec['tokens_per_s'] / tps:10.2f}  "
            f"{rec['acceptance_length']:7.2f}  {rec['k_per_bucket']}")
  if "speedups" in s:
    print("\nspeedups (main batch):", {k: round(v, 3) for k, v in s["speedups"].items()})
  if "ar_batch1" in s:
    x = s["ar_batch1"]
    n = len(x["rounds"]["ar_gb_s"])
    print(f"AR batch 1, decode loop (medians of {n} rounds, each measured beside its roofs): "
          f"{x['s_per_token'] * 1e3:.2f} ms/token = {x['ar_gb_s']:.1f} GB/s of weights; "
          f"{100 * x['fraction_of_read_bw']:.0f}% of a 512 MB read ({x['read_gb_s']:.1f} GB/s), "
          f"{100 * x['fraction_of_matvec_roof']:.0f}% of a bare chain of the same matrix-vector "
          f"products ({x['matvec_gb_s']:.1f} GB/s)")


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
