"""History drafting at dataset scale: the host store's memory and costs against the prompts and
completions it keeps, and the device's per-draft-step lookup against a drafting step.

  python experiments/bench_history.py --out runs/bench_history.json

Host: a `HistoryStore` filled with every prompt of a dataset of `--prompts` prompts (each seen
once: rollouts of `rows` rows, G = `group` samples per prompt, completions of random lengths up to
`width` tokens), for each count of completions kept per prompt; measured: the bytes it holds and
all it allocates (Python's allocation tracer), seconds to record a rollout, to build a rollout's device
table, and to write and read back the checkpoint JSON. Device: `history_lookup` (the drafter's
work at every draft step: each row's own entries, whatever the store holds) and its sampled form,
timed in a jitted loop at the main job's shape, against one drafting step of the main job's
policy (a verify of K + 1 tokens per row, random weights). Prints tables and writes JSON. No
assertions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from specjax.config_tree import apply_cli  # noqa: E402
from specjax.drafters import (CorpusStore, HistoryStore, corpus_lookup,  # noqa: E402
                              history_lookup)
from specjax.drafters.history import history_sample  # noqa: E402
from specjax.jobs import run_main  # noqa: E402
from specjax.models import Decoder  # noqa: E402
from specjax.sampling.cost_cache import write_json_atomic  # noqa: E402
from specjax.sampling.drafter import Sequences  # noqa: E402
from specjax.sim.measure import ITERS, _timed, time_forward  # noqa: E402


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  prompts: tuple[int, ...] = (1000, 5000, 20000)  # dataset sizes, every prompt recorded
  per_prompt: tuple[int, ...] = (1, 4, 8)  # completions kept per prompt
  width: int = 256  # tokens per entry (prompt tail + completion)
  prompt_len: int = 48
  vocab: int = 49152  # token ids drawn below this (a real tokenizer's size)
  rows: int = 64  # rows per rollout (prompts x G)
  group: int = 4
  # the device side: the main job's drafting shape (its policy, K = 7, n-gram 3 down to 1)
  batches: tuple[int, ...] = (8, 64)
  draft_len: int = 7
  ngram_max: int = 3
  window: int = 256  # the policy's cache positions at the timed step
  corpus_slots: int = 65536  # the cross-prompt table's (DraftConfig.corpus_slots) ...
  corpus_orders: tuple[int, int] = (3, 8)  # ... and its n-gram orders (corpus_min_match, _max)
  repeats: int = 5
  seed: int = 0
  out: str | None = None
  smoke: bool = False  # tiny sizes, for a test of the script's paths


def traced_bytes(cfg: BenchConfig, n: int, h: int) -> int:
  """Host bytes a store holds once every prompt of n kept h completions: Python's allocation
  tracer (numpy's arrays included) over a second fill of the same sizes, untimed."""
  rng = np.random.default_rng(cfg.seed)
  completions = cfg.width - cfg.ngram_max
  tracemalloc.start()
  try:
    base = tracemalloc.get_traced_memory()[0]
    store = HistoryStore(max_prompts=n, per_prompt=h, width=cfg.width, tail=cfg.ngram_max)
    for start in range(0, n, cfg.rows):
      rows = rng.integers(3, cfg.vocab, (min(cfg.rows, n - start), cfg.prompt_len),
                          dtype=np.int32)
      plens = np.full((len(rows),), cfg.prompt_len, np.int32)
      for _ in range(h):
        comp = rng.integers(3, cfg.vocab, (len(rows), completions), dtype=np.int32)
        store.record(rows, plens, comp, np.full((len(rows),), completions))
      del rows, comp
    return tracemalloc.get_traced_memory()[0] - base
  finally:
    tracemalloc.stop()


def host_rows(cfg: BenchConfig, rng: np.random.Generator, log) -> list[dict]:
  out = []
  completions = cfg.width - cfg.ngram_max
  for h in cfg.per_prompt:
    for n in cfg.prompts:
      store = HistoryStore(max_prompts=n, per_prompt=h, width=cfg.width, tail=cfg.ngram_max)
      corpus = CorpusStore(cfg.corpus_slots, cfg.draft_len, *cfg.corpus_orders)
      corpus_s = []
      prompts = rng.integers(3, cfg.vocab, (n, cfg.prompt_len), dtype=np.int32)
      record_s, table_s, rollouts = [], [], 0
      per_rollout = cfg.rows // cfg.group
      # every prompt of the dataset once per visit, h visits: each keeps h completions
      for _ in range(h):
        for start in range(0, n, per_rollout):
          rows = np.repeat(prompts[start:start + per_rollout], cfg.group, axis=0)
          plens = np.full((len(rows),), cfg.prompt_len, np.int32)
          t0 = time.perf_counter()
          table = store.table(rows, plens)
          jax.block_until_ready(table.tokens)
          table_s.append(time.perf_counter() - t0)
          comp = rng.integers(3, cfg.vocab, (len(rows), completions), dtype=np.int32)
          lens = rng.integers(completions // 4, completions + 1, (len(rows),))
          t0 = time.perf_counter()
          store.record(rows, plens, comp, lens)
          record_s.append(time.perf_counter() - t0)
          t0 = time.perf_counter()
          corpus.record(np.concatenate([p[-cfg.corpus_orders[1]:], c[:cl]])
                        for p, c, cl in zip(rows, comp, lens))
          corpus_s.append(time.perf_counter() - t0)
          rollouts += 1
      t0 = time.perf_counter()
      text = json.dumps(store.to_json())
      save_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      again = HistoryStore(max_prompts=n, per_prompt=h, width=cfg.width, tail=cfg.ngram_max)
      again.load_json(json.loads(text))
      load_s = time.perf_counter() - t0
      row = dict(prompts=n, per_prompt=h, width=cfg.width, completions=store.recorded,
                 bytes=store.nbytes, traced_bytes=traced_bytes(cfg, n, h), rollouts=rollouts,
                 record_ms_per_rollout=1e3 * statistics.median(record_s),
                 table_ms_per_rollout=1e3 * statistics.median(table_s),
                 corpus_record_ms_per_rollout=1e3 * statistics.median(corpus_s),
                 corpus_filled=corpus.filled,
                 table_device_bytes=int(table.tokens.nbytes + table.lengths.nbytes),
                 checkpoint_json_bytes=len(text), checkpoint_save_s=save_s,
                 checkpoint_load_s=load_s)
      out.append(row)
      log(f"host: {n} prompts x {h}: {row['bytes'] / 2**20:.1f} MiB held "
          f"({row['traced_bytes'] / 2**20:.1f} MiB allocated), record {row['record_ms_per_rollout']:.2f} ms, "
          f"table {row['table_ms_per_rollout']:.2f} ms per rollout of {cfg.rows} rows, "
          f"cross-prompt table {row['corpus_record_ms_per_rollout']:.2f} ms, "
          f"checkpoint {len(text) / 2**20:.1f} MiB in {save_s:.2f} s")
      del store, again, text, prompts, corpus
  return out


def time_lookup(cfg: BenchConfig, batch: int, per_prompt: int, sampled: bool, vocab: int,
                rng: np.random.Generator) -> float:
  """Median seconds of one draft step's history lookup (or sampled draft) for `batch` rows, each
  holding `per_prompt` entries of `width` tokens, timed as ITERS lookups in one jitted loop."""
  completions = cfg.width - cfg.ngram_max
  hist = jnp.asarray(rng.integers(3, vocab, (batch, per_prompt, cfg.width)), jnp.int32)
  hist_len = jnp.asarray(rng.integers(completions // 4, cfg.width + 1, (batch, per_prompt)),
                         jnp.int32)
  length = cfg.prompt_len + completions // 2
  seq = Sequences(tokens=jnp.asarray(rng.integers(3, vocab, (batch, cfg.window)), jnp.int32),
                  lengths=jnp.full((batch,), length, jnp.int32),
                  prompt_lengths=jnp.full((batch,), cfg.prompt_len, jnp.int32))
  k, n = cfg.draft_len, cfg.ngram_max

  @jax.jit
  def run(seq, hist, hist_len, key):
    def body(i, carry):
      seq, acc = carry
      drafts, matched = history_lookup(seq, hist, hist_len, k, n, 1, n)
      if sampled:
        drafts, q = history_sample(seq, hist, hist_len, drafts, n, 1, n, vocab,
                                   jax.random.fold_in(key, i))
        drafts = drafts + (q[:, :, 0] > 2).astype(jnp.int32)  # (keeps q computed)
      # the next step's row is one token longer (the lookup cannot be hoisted)
      seq = seq.replace(lengths=seq.lengths + (drafts[:, 0] < 0) + 1 - (i % 2) * 2)
      return seq, acc + jnp.sum(drafts) + jnp.sum(matched)
    return jax.lax.fori_loop(0, ITERS, body, (seq, jnp.int32(0)))[1]

  key = jax.random.key(0)
  jax.block_until_ready(run(seq, hist, hist_len, key))
  wall, _, _ = _timed(lambda: run(seq, hist, hist_len, key), cfg.repeats)
  return statistics.median(wall) / ITERS


def time_corpus_lookup(cfg: BenchConfig, batch: int, table, vocab: int,
                       rng: np.random.Generator) -> float:
  """Median seconds of one draft step's cross-prompt lookup for `batch` rows (ITERS in a loop)."""
  seq = Sequences(tokens=jnp.asarray(rng.integers(3, vocab, (batch, cfg.window)), jnp.int32),
                  lengths=jnp.full((batch,), cfg.window // 2, jnp.int32),
                  prompt_lengths=jnp.full((batch,), cfg.prompt_len, jnp.int32))

  @jax.jit
  def run(seq, table):
    def body(i, carry):
      seq, acc = carry
      drafts, matched = corpus_lookup(seq, table, cfg.draft_len)
      seq = seq.replace(lengths=seq.lengths + (drafts[:, 0] < 0) + 1 - (i % 2) * 2)
      return seq, acc + jnp.sum(drafts) + jnp.sum(matched)
    return jax.lax.fori_loop(0, ITERS, body, (seq, jnp.int32(0)))[1]

  jax.block_until_ready(run(seq, table))
  wall, _, _ = _timed(lambda: run(seq, table), cfg.repeats)
  return statistics.median(wall) / ITERS


def device_rows(cfg: BenchConfig, log) -> tuple[list[dict], dict]:
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import rl_zero  # the main job's policy shape

  model_cfg = rl_zero.DEFAULTS.rl.model
  if cfg.smoke:
    model_cfg = dataclasses.replace(model_cfg, hidden_size=32, num_layers=2, mlp_hidden=64,
                                    head_dim=8, aux_layers=(1,))
  model = Decoder(model_cfg, rngs=nnx.Rngs(cfg.seed))
  rng = np.random.default_rng(cfg.seed + 1)
  out = []
  for b in cfg.batches:
    step_s, _ = time_forward(model, b, cfg.draft_len + 1, cfg.window, cfg.repeats)
    corpus = CorpusStore(cfg.corpus_slots, cfg.draft_len, *cfg.corpus_orders)
    corpus.record(rng.integers(3, model_cfg.vocab_size, (cfg.rows, cfg.width)))
    s = time_corpus_lookup(cfg, b, corpus.table(), model_cfg.vocab_size, rng)
    out.append(dict(batch=b, per_prompt=0, sampled=False, corpus=True, lookup_ms=1e3 * s,
                    drafting_step_ms=1e3 * step_s, lookup_share=s / step_s))
    log(f"device: {b} rows, cross-prompt table of {cfg.corpus_slots} slots: lookup "
        f"{1e3 * s:.3f} ms, {100 * s / step_s:.1f}% of a K = {cfg.draft_len} step")
    for h in cfg.per_prompt:
      for sampled in (False, True):
        s = time_lookup(cfg, b, h, sampled, model_cfg.vocab_size, rng)
        row = dict(batch=b, per_prompt=h, sampled=sampled, corpus=False, lookup_ms=1e3 * s,
                   drafting_step_ms=1e3 * step_s, lookup_share=s / step_s)
        out.append(row)
        log(f"device: {b} rows x {h} entries{' (sampled)' if sampled else ''}: lookup "
            f"{1e3 * s:.3f} ms, {100 * s / step_s:.1f}% of a K = {cfg.draft_len} step "
            f"({1e3 * step_s:.2f} ms)")
  policy = dict(params=model_cfg.num_params(), vocab=model_cfg.vocab_size,
                layers=model_cfg.num_layers, hidden=model_cfg.hidden_size)
  return out, policy


def format_tables(report: dict) -> str:
  lines = ["Host store (every prompt recorded; per rollout of "
           f"{report['config']['rows']} rows):", "",
           "| prompts | per prompt | tokens held | allocated | record / rollout | table / rollout "
           "| cross-prompt record / rollout | checkpoint JSON | save | load |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in report["host"]:
    lines.append(f"| {r['prompts']} | {r['per_prompt']} | {r['bytes'] / 2**20:.1f} MiB | "
                 f"{r['traced_bytes'] / 2**20:.1f} MiB | {r['record_ms_per_rollout']:.2f} ms | "
                 f"{r['table_ms_per_rollout']:.2f} ms | {r['corpus_record_ms_per_rollout']:.2f} ms | "
                 f"{r['checkpoint_json_bytes'] / 2**20:.1f} MiB | {r['checkpoint_save_s']:.2f} s | "
                 f"{r['checkpoint_load_s']:.2f} s |")
  p = report["policy"]
  lines += ["", f"Device lookup per draft step against one K = {report['config']['draft_len']} "
            f"drafting step of the main job's policy ({p['params'] / 1e6:.1f}M parameters):", "",
            "| rows | entries per row | lookup | sampled lookup | drafting step | share | "
            "sampled share |", "|---:|---:|---:|---:|---:|---:|---:|"]
  by = {(r["batch"], r["per_prompt"], r["sampled"]): r for r in report["device"]
        if not r["corpus"]}
  for (b, h, sampled), r in by.items():
    if sampled:
      continue
    s = by[b, h, True]
    lines.append(f"| {b} | {h} | {r['lookup_ms']:.3f} ms | {s['lookup_ms']:.3f} ms | "
                 f"{r['drafting_step_ms']:.2f} ms | {100 * r['lookup_share']:.1f}% | "
                 f"{100 * s['lookup_share']:.1f}% |")
  c = report["config"]
  lines += ["", f"Cross-prompt table ({c['corpus_slots']} slots, orders {c['corpus_orders'][0]}-"
            f"{c['corpus_orders'][1]}) lookup per draft step:", "",
            "| rows | lookup | drafting step | share |", "|---:|---:|---:|---:|"]
  for r in report["device"]:
    if r["corpus"]:
      lines.append(f"| {r['batch']} | {r['lookup_ms']:.3f} ms | {r['drafting_step_ms']:.2f} ms | "
                   f"{100 * r['lookup_share']:.1f}% |")
  return "\n".join(lines)


def main(cfg: BenchConfig) -> dict:
  if cfg.smoke:
    cfg = dataclasses.replace(cfg, prompts=(40,), per_prompt=(2,), width=24, prompt_len=6,
                              rows=8, group=2, batches=(2,), window=32, repeats=1,
                              vocab=500, corpus_slots=256)
  start = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)
  rng = np.random.default_rng(cfg.seed)
  report = dict(config=dataclasses.asdict(cfg), platform=platform.platform(),
                cpus=os.cpu_count(), backend=jax.default_backend(), jax=jax.__version__)
  jax.block_until_ready(jnp.zeros((8,)) + 1)  # (the runtime's own memory is not the store's)
  report["host"] = host_rows(cfg, rng, log)
  report["device"], report["policy"] = device_rows(cfg, log)
  report["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  report["total_s"] = time.perf_counter() - start
  print(format_tables(report))
  if cfg.out:
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    write_json_atomic(cfg.out, report)
  return report


if __name__ == "__main__":
  # a user's mistake: one line on stderr, exit code 2 (README)
  run_main(lambda args: main(apply_cli(BenchConfig(), args)))
