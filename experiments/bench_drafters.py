"""Drafter benchmark on the embedded arithmetic task: acceptance length and speedup vs AR per K.

  python experiments/bench_drafters.py --out runs/bench_drafters.json

A tiny character-level target (with a native MTP module) is pretrained on arithmetic + English
text; then EAGLE-3 heads are trained offline on arithmetic (in-domain) or English (general)
rollouts, the MTP module is fine-tuned on the in-domain rollouts, a one-layer draft model is
pretrained on the same text; every drafter then decodes held-out arithmetic prompts for each K.
Each (drafter, K) runs once to compile, then --repeats timed runs alternating with AR runs
(medians; the speedup is the ratio of tokens/s). Prints a table and
writes JSON. No assertions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import toy  # noqa: E402
from specjax.config_tree import apply_cli  # noqa: E402
from specjax.drafters import (DraftTrainConfig, collect_rollouts, eagle3_drafter,  # noqa: E402
                           eval_ttt, identity_maps, init_head, mtp_drafter, train_draft_head)
from specjax.jobs import run_main  # noqa: E402
from specjax.jobs.pretrain import LmTrainConfig, train_lm  # noqa: E402
from specjax.models.tokenizer import CharTokenizer  # noqa: E402
from specjax.drafters import DraftModelDrafter, NgramDrafter  # noqa: E402
from specjax.sampling import (AcceptanceMetrics, EngineTuning, SamplingConfig,  # noqa: E402
                              generate, speculative_generate)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  hidden: int = 64
  layers: int = 4
  pretrain_steps: int = 600
  pretrain_texts: int = 4000
  head_steps: int = 300
  head_prompts: int = 256  # training prompts per set (in-domain, general)
  mtp_steps: int = 300  # MTP fine-tune on the in-domain rollouts (frozen trunk)
  draft_hidden: int = 32
  draft_layers: int = 1
  eval_prompts: int = 128
  max_new_tokens: int = 28
  temperature: float = 1.0
  draft_lens: tuple[int, ...] = (1, 2, 3, 5, 7)
  ngram_n: int = 3
  repeats: int = 10
  seed: int = 0
  machine: str = "2-core CPU, jax 0.10.2"
  out: str | None = None


def timed_pair(ar_fn, spec_fn, repeats: int):
  """(spec result, spec median s, AR median s, spec compile s): one warm-up call each, then
  `repeats` alternating AR / speculative calls, so that load drift on a shared machine hits both
  sides of the ratio alike."""
  jax.block_until_ready(ar_fn())
  t = time.perf_counter()
  out = jax.block_until_ready(spec_fn())
  first = time.perf_counter() - t
  spec_times, ar_times = [], []
  for _ in range(repeats):
    for fn, times in ((ar_fn, ar_times), (spec_fn, spec_times)):
      t = time.perf_counter()
      res = jax.block_until_ready(fn())
      times.append(time.perf_counter() - t)
      if fn is spec_fn:
        out = res
  spec_s, ar_s = statistics.median(spec_times), statistics.median(ar_times)
  return out, spec_s, ar_s, max(first - spec_s, 0.0)


def build_drafters(cfg: BenchConfig, log):
  tok = CharTokenizer()
  target_cfg = toy.toy_target_config(mtp=True, hidden_size=cfg.hidden, num_layers=cfg.layers,
                                     mlp_hidden=2 * cfg.hidden, head_dim=cfg.hidden // 4)
  target = toy.pretrain_toy_target(target_cfg, steps=cfg.pretrain_steps,
                                   num_texts=cfg.pretrain_texts, seed=cfg.seed, progress=True)
  log("pretrained target (LM + MTP)")
  draft_cfg = toy.toy_target_config(mtp=False, hidden_size=cfg.draft_hidden,
                                    num_layers=cfg.draft_layers, mlp_hidden=2 * cfg.draft_hidden,
                                    head_dim=cfg.draft_hidden // 2, num_heads=2, num_kv_heads=1)
  draft_model = toy.pretrain_toy_target(draft_cfg, steps=cfg.pretrain_steps,
                                        num_texts=cfg.pretrain_texts, seed=cfg.seed,
                                        progress=True)
  log("pretrained draft model")
  sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            eos_ids=tok.eos_ids, pad_id=tok.pad_id)
  prompt_set = lambda kind, n, seed: toy.encode_prompts(
      tok, [p for p, _ in toy.examples(kind, n, seed)], width=16)
  train_cfg = DraftTrainConfig(steps=cfg.head_steps, batch_size=16,
                               warmup_steps=min(20, cfg.head_steps // 10),
                               seed=cfg.seed)
  heads = {"eagle3 untrained": (init_head(target_cfg, seed=cfg.seed),
                                identity_maps(target_cfg.vocab_size))}
  rollouts = {}
  for kind, name in (("arithmetic", "eagle3 in-domain"), ("general", "eagle3 general")):
    res = train_draft_head(target, *prompt_set(kind, cfg.head_prompts, cfg.seed + 11),
                           sampling=sampling, config=train_cfg, progress=True)
    heads[name] = (res.head, res.maps)
    rollouts[kind] = res.rollouts
    log(f"trained {name}: loss {res.history[0]['loss']:.3f} -> {res.history[-1]['loss']:.3f}")
  held_out = prompt_set("arithmetic", cfg.eval_prompts, cfg.seed + 99)
  mtp_model, _ = train_lm(target, rollouts["arithmetic"].tokens, rollouts["arithmetic"].loss_mask,
                          LmTrainConfig(steps=cfg.mtp_steps, batch_size=16, mtp_only=True,
                                        warmup_steps=min(20, cfg.mtp_steps // 10), seed=cfg.seed), progress=True)
  log("fine-tuned MTP module")
  # held-out TTT agreement of each head with the target, on in-domain rollouts
  eval_rollouts = collect_rollouts(target, *held_out, jax.random.key(cfg.seed + 5), sampling)
  agreement = {name: eval_ttt(target, h, m, eval_rollouts) for name, (h, m) in heads.items()}

  def make(name, k):
    if name.startswith("eagle3"):
      head, maps = heads[name]
      return (target,) + eagle3_drafter(head, target.embed[...], maps, draft_len=k)
    if name == "mtp joint":
      return (target,) + mtp_drafter(target, draft_len=k)
    if name == "mtp fine-tuned":
      return (mtp_model,) + mtp_drafter(mtp_model, draft_len=k)
    if name == "draft model":
      return (target,) + DraftModelDrafter.from_model(draft_model, k)
    if name == "ngram":
      return target, NgramDrafter(draft_len=k, n=cfg.ngram_n), ()
    raise KeyError(name)

  names = list(heads) + ["mtp joint", "mtp fine-tuned", "draft model", "ngram"]
  return target, sampling, held_out, names, make, agreement


def main(cfg: BenchConfig) -> dict:
  start = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)
  target, sampling, (prompts, lengths), names, make, agreement = build_drafters(cfg, log)
  key = jax.random.key(cfg.seed + 7)
  run_ar = lambda: generate(target, prompts, lengths, key, sampling)
  ar = jax.block_until_ready(run_ar())
  ar_tokens = int(np.asarray(ar.lengths).sum())
  rows = []
  for name in names:
    for k in cfg.draft_lens:
      model, drafter, params = make(name, k)
      tuning = EngineTuning()  # calibrated in the untimed first run, reused by the timed ones
      out, sec, ar_s, comp = timed_pair(
          run_ar, lambda: speculative_generate(model, drafter, params, prompts, lengths, key,
                                               sampling, tuning=tuning), cfg.repeats)
      m = AcceptanceMetrics.from_counts(out.stats)
      tokens = int(np.asarray(out.lengths).sum())
      rows.append(dict(method=name, draft_len=k, seconds=sec, tokens_per_s=tokens / sec,
                       ar_seconds=ar_s, ar_tokens_per_s=ar_tokens / ar_s,
                       speedup=(tokens / sec) / (ar_tokens / ar_s),
                       acceptance_length=m.acceptance_length, acceptance_rate=m.acceptance_rate,
                       per_position=list(m.per_position_acceptance_rate), compile_s=comp))
      log(f"{name} K={k}: acc. length {m.acceptance_length:.2f}, {tokens / sec:.1f} tokens/s "
          f"(AR {ar_tokens / ar_s:.1f})")
  report = dict(config=dataclasses.asdict(cfg), machine=cfg.machine, platform=platform.platform(),
                backend=jax.default_backend(), rows=rows, ttt_agreement=agreement,
                total_s=time.perf_counter() - start)
  print(format_tables(report))
  if cfg.out:
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    with open(cfg.out, "w") as f:
      json.dump(report, f, indent=1)
  return report


def format_tables(report: dict) -> str:
  rows = report["rows"]
  ks = sorted({r["draft_len"] for r in rows})
  methods = list(dict.fromkeys(r["method"] for r in rows))
  by = {(r["method"], r["draft_len"]): r for r in rows}
  head = "| drafter | " + " | ".join(f"K={k}" for k in ks) + " |"
  rule = "|---|" + "---|" * len(ks)
  out = ["Acceptance length (1 + accepted / drafts):", "", head, rule]
  for m in methods:
    out.append(f"| {m} | " + " | ".join(f"{by[m, k]['acceptance_length']:.2f}" for k in ks) + " |")
  ar_rate = statistics.median(r["ar_tokens_per_s"] for r in rows)
  out += ["", f"Speedup vs AR (tokens/s ratio, AR timed alternately with each run; median AR "
          f"{ar_rate:.0f} tokens/s):", "", head, rule]
  for m in methods:
    out.append(f"| {m} | " + " | ".join(f"{by[m, k]['speedup']:.2f}x" for k in ks) + " |")
  out += ["", "Held-out TTT top-1 agreement with the target (step 0 / 1 / 2):", ""]
  for name, a in report["ttt_agreement"].items():
    out.append(f"- {name}: {a['acc_0']:.3f} / {a['acc_1']:.3f} / {a['acc_2']:.3f}")
  return "\n".join(out)


if __name__ == "__main__":
  # a user's mistake: one line on stderr, exit code 2 (README)
  run_main(lambda args: main(apply_cli(BenchConfig(), args)))
