"""The AR-vs-speculative RL experiment behind experiments/rl_zero.py and rl_think.py.

Stages: base policy (pretrained here and cached, or a local HF checkpoint) -> offline EAGLE-3 draft
initialisation on the base policy's rollouts (cached) -> two GRPO runs from the same seed and data
order, AR and speculative -> report (summary.json, plots, table; see `report.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from typing import Any, Callable, Sequence

import numpy as np
from flax import nnx

from specjax.config_tree import check, one_of, parse_args
from specjax.experiment.run_dir import (Replacement, check_flags, check_model_dir, check_policy,
                                        claim_run_dir, run_paths)
from specjax.rl.async_rl.config import AsyncConfig
from specjax.rl.config import RLConfig

Examples = Callable[[Any, int, int, float], list]  # (task, n, seed, bias) -> [(prompt, completion)]


@dataclasses.dataclass(frozen=True)
class BaseModelConfig:
  """How the base policy is built when no --model-path is given."""

  steps: int = 150  # few on purpose: the base model should be weak, not useless
  examples: int = 4000
  batch_size: int = 64
  lr: float = 3e-3
  finetune_steps: int = 0  # rl_think: extra SFT steps on scratchpad text on top of the base
  # Fraction of training answers replaced by a systematic mistake (off by one): the base policy
  # then prefers a wrong answer but keeps the right one in its distribution, which RL can find.
  bias: float = 0.0
  # Pretrain a smaller decoder, then grow it function-preservingly to --rl.model
  # (`specjax.experiment.grow`): this many layers and MLP units (0: --rl.model's own). A policy
  # large enough to be memory-bound in decode cannot be pretrained in minutes on a small CPU.
  pretrain_layers: int = 0
  pretrain_mlp_hidden: int = 0
  # minibatches of similar-length texts, each cut to its own width (long-tailed scratchpads)
  length_batches: bool = True
  # seed of the base policy's data and init; -1: --rl.seed (set it to compare RL seeds on one
  # base policy: experiments/rl_zero_seeds.py)
  seed: int = -1

  def __post_init__(self):
    w = "BaseModelConfig"
    for name in ("steps", "examples", "batch_size"):
      check(getattr(self, name) >= 1, f"{w}.{name}", f"must be >= 1, got {getattr(self, name)}")
    check(self.seed >= -1, f"{w}.seed", f"must be >= 0, or -1 for --rl.seed, got {self.seed}")
    for name in ("pretrain_layers", "pretrain_mlp_hidden"):
      check(getattr(self, name) >= 0, f"{w}.{name}",
            f"must be >= 0 (0: --rl.model's), got {getattr(self, name)}")
    check(self.lr > 0, f"{w}.lr", f"must be > 0, got {self.lr}")
    check(0 <= self.bias < 1, f"{w}.bias", f"must be in [0, 1), got {self.bias}")
    check(self.finetune_steps >= 0, f"{w}.finetune_steps",
          f"must be >= 0, got {self.finetune_steps}")


@dataclasses.dataclass(frozen=True)
class DraftInitConfig:
  """The draft built before RL: an EAGLE-3 head or an MTP module trained offline on the base
  policy's rollouts (when no --rl.draft.path / checkpoint weights give one), or a truncated copy
  of the policy as the draft model."""

  steps: int = 200
  prompts: int = 256
  batch_size: int = 32
  lr: float = 3e-3
  domain: str = "in-domain"  # in-domain: the RL task's prompts; general: other text
  draft_model_layers: int = 1  # draft-model without --rl.draft.path: the policy's first N layers
  # EAGLE-3 draft vocabulary: the most frequent completion tokens (0: min(vocab, 32000))
  draft_vocab: int = 0
  # MLP width of the EAGLE-3 head's decoder layer (0: the policy's): a narrower head drafts and
  # trains for a fraction of a policy layer's cost
  head_mlp_hidden: int = 0

  def __post_init__(self):
    w = "DraftInitConfig"
    for name in ("steps", "prompts", "batch_size", "draft_model_layers"):
      check(getattr(self, name) >= 1, f"{w}.{name}", f"must be >= 1, got {getattr(self, name)}")
    for name in ("draft_vocab", "head_mlp_hidden"):
      check(getattr(self, name) >= 0, f"{w}.{name}",
            f"must be >= 0 (0: the default), got {getattr(self, name)}")
    one_of(self.domain, ("in-domain", "general"), f"{w}.domain")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  name: str = "rl_zero"
  out_dir: str = "runs"  # the report goes to <out_dir>/<name>/
  cache_dir: str = ".cache/specjax"  # base policies and draft heads, keyed by their config
  # an existing <out_dir>/<name> is refused unless one of these says what to do with it
  fresh: bool = False  # start over: replace the earlier run (once the new one's checks pass) and
  #                      rebuild the cached base policy and draft head
  resume: bool = False  # continue both runs from their own last checkpoints
  model_path: str = ""  # a local Hugging Face checkpoint (skips base pretraining)
  dataset: str = ""  # a local math set (GSM8K or DAPO rows): JSON/JSONL/parquet or a datasets dir
  # the tokenizer's chat template: "" (the checkpoint's own; an error if it has none), "none"
  # (plain "User: ..." prompts), a .jinja/.json file, or a jinja string
  chat_template: str = ""
  export_hf: str = ""  # after the runs: the final policy as a Hugging Face dir (+ eagle3/ head)
  compare: bool = True  # also run the AR baseline (False: only the configured rollout mode)
  # sync RL with both arms: run them step by step in turn in this process (AR step 1, spec step
  # 1, AR step 2, ...), so that both see the machine in the same state and its drift does not
  # enter the speedups. Both arms' train states are held at once (twice the memory of one run);
  # False: the AR run to its end, then the speculative one
  interleave: bool = True
  base: BaseModelConfig = BaseModelConfig()
  draft_init: DraftInitConfig = DraftInitConfig()
  rl: RLConfig = RLConfig()
  async_rl: AsyncConfig = AsyncConfig()

  def __post_init__(self):
    check(bool(self.name) and os.sep not in self.name, "ExperimentConfig.name",
          f"must be a plain directory name, got {self.name!r}")


def parse_config(defaults: ExperimentConfig, argv: Sequence[str] | None = None) -> ExperimentConfig:
  """defaults <- YAML (`--config file.yaml`, nested like the dataclasses) <- CLI flags (tyro)."""
  import tyro

  return parse_args(defaults, argv, config=(tyro.conf.AvoidSubcommands,),
                    description="AR vs speculative GRPO on one task (see README).")


def _digest(*parts: Any) -> str:
  blob = json.dumps([dataclasses.asdict(p) if dataclasses.is_dataclass(p) else p for p in parts],
                    sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _atomic_dir(final: str, write: Callable[[str], None]) -> None:
  """Write a directory under a temporary name, then rename: a crash never leaves half a cache."""
  tmp = f"{final}.tmp-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  write(tmp)
  shutil.rmtree(final, ignore_errors=True)
  os.replace(tmp, final)


def general_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
  """A "general" prompt set for the out-of-domain draft comparison: word-like text."""
  rng = np.random.default_rng(seed)
  words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "home"]
  return [tokenizer.encode(" ".join(rng.choice(words, size=4)) + " ", bos=True) for _ in range(n)]


def biased_answer(example, rng: np.random.Generator, bias: float) -> str:
  """The example's answer, or with probability `bias` the systematic mistake answer + 1."""
  return str(int(example.answer) + 1) if rng.random() < bias else example.answer


def build_tokenizer(cfg: ExperimentConfig):
  from specjax.models import CharTokenizer, load_tokenizer

  if cfg.model_path:
    return load_tokenizer(cfg.model_path, cfg.chat_template or None)
  check(not cfg.chat_template, "ExperimentConfig.chat_template",
        "applies to a --model-path tokenizer; the embedded default has its own")
  return CharTokenizer()


def build_task(cfg: ExperimentConfig, tokenizer):
  from specjax.rl.tasks import make_task

  task_cfg = cfg.rl.task
  if cfg.dataset:
    task_cfg = dataclasses.replace(task_cfg, name="math", path=cfg.dataset)
  return make_task(task_cfg, tokenizer)


def _model_cfg(cfg: ExperimentConfig, tokenizer):
  m = cfg.rl.model
  if m.vocab_size < tokenizer.vocab_size:
    m = m.replace(vocab_size=tokenizer.vocab_size)
  return m


def _pretrain(model_cfg, examples: list, tokenizer, base: BaseModelConfig, steps: int, seed: int,
              start=None, *, progress: bool):
  from specjax.models import Decoder
  from specjax.experiment.pretrain import pretrain_lm

  model = start if start is not None else Decoder(model_cfg, rngs=nnx.Rngs(seed))
  model, history = pretrain_lm(model, examples, tokenizer, steps=steps,
                               batch_size=base.batch_size, lr=base.lr, seed=seed,
                               length_batches=base.length_batches, progress=progress)
  return model, history


def pretrain_model_cfg(model_cfg, base: BaseModelConfig):
  """The config the base policy is pretrained at: `model_cfg` with BaseModelConfig's
  pretrain_layers / pretrain_mlp_hidden (then grown to `model_cfg`), or `model_cfg` itself."""
  layers = base.pretrain_layers or model_cfg.num_layers
  mlp = base.pretrain_mlp_hidden or model_cfg.mlp_hidden
  if (layers, mlp) == (model_cfg.num_layers, model_cfg.mlp_hidden):
    return model_cfg
  from specjax.experiment.grow import check_growth

  small = model_cfg.replace(num_layers=layers, mlp_hidden=mlp, aux_layers=None)
  check_growth(small, model_cfg)
  return small


def build_base_policy(cfg: ExperimentConfig, tokenizer, task, base_examples: Examples,
                      finetune_examples: Examples | None = None, log=print):
  """The policy RL starts from: a local HF checkpoint, or a small decoder pretrained here on the
  task's text (and, for rl_think, fine-tuned on scratchpad text), cached under cache_dir; loaded
  with what the draft method needs of it (an MTP module, a published head's aux layers)."""
  path = base_policy_dir(cfg, tokenizer, task, base_examples, finetune_examples, log=log)
  return load_base_policy(cfg, tokenizer, path, log=log)


def load_base_policy(cfg: ExperimentConfig, tokenizer, path: str, log=print):
  """The base policy at `path` (see `base_policy_dir`), with the draft method's overrides."""
  from specjax.models import load_pretrained

  overrides = cfg.rl.draft.method.policy_overrides(cfg.rl.draft, path)
  if cfg.model_path:
    log(f"[base] loading {cfg.model_path}")
    return load_pretrained(cfg.model_path, dtype=cfg.rl.model.dtype, **overrides)
  model_cfg = _model_cfg(cfg, tokenizer)
  overrides = dict(dict(aux_layers=model_cfg.aux_layers, mtp=model_cfg.mtp,
                        init_std=model_cfg.init_std, param_dtype=model_cfg.param_dtype),
                   **overrides)
  return load_pretrained(path, dtype=model_cfg.dtype, **overrides)


def base_policy_dir(cfg: ExperimentConfig, tokenizer, task, base_examples: Examples,
                    finetune_examples: Examples | None = None, log=print) -> str:
  """The Hugging Face directory of the base policy: --model-path, or the cached pretrained one
  (built here first when absent)."""
  from specjax.models import save_pretrained

  if cfg.model_path:
    return cfg.model_path
  model_cfg = _model_cfg(cfg, tokenizer)
  seed = cfg.base.seed if cfg.base.seed >= 0 else cfg.rl.seed
  # aux_layers only picks which hidden states a forward exports: not part of the weights' key
  key = _digest("base", model_cfg.replace(aux_layers=None),
                dataclasses.replace(cfg.base, seed=seed), cfg.rl.task, seed,
                finetune_examples is not None)
  path = os.path.join(cfg.cache_dir, f"base-{key}")
  if os.path.isdir(path) and not cfg.fresh:
    log(f"[base] cached base policy {path}")
    return path
  t0 = time.perf_counter()
  small_cfg = pretrain_model_cfg(model_cfg, cfg.base)
  log(f"[base] pretraining a {small_cfg.num_params() / 1e6:.2f}M-parameter decoder on the task's "
      f"text ({cfg.base.steps} steps)")
  model, _ = _pretrain(small_cfg, base_examples(task, cfg.base.examples, seed, cfg.base.bias),
                       tokenizer, cfg.base, cfg.base.steps, seed, progress=cfg.rl.progress)
  if finetune_examples is not None and cfg.base.finetune_steps:
    log(f"[base] fine-tuning on scratchpad text ({cfg.base.finetune_steps} steps)")
    texts = finetune_examples(task, cfg.base.examples, seed + 1, cfg.base.bias)
    model, _ = _pretrain(small_cfg, texts, tokenizer, cfg.base, cfg.base.finetune_steps, seed + 1,
                         start=model, progress=cfg.rl.progress)
  if small_cfg is not model_cfg:
    from specjax.experiment.grow import grow_decoder

    model = grow_decoder(model, model_cfg, seed=seed)
    log(f"[base] grown function-preservingly to {model_cfg.num_params() / 1e6:.2f}M parameters "
        f"({small_cfg.num_layers} -> {model_cfg.num_layers} layers, MLP {small_cfg.mlp_hidden} -> "
        f"{model_cfg.mlp_hidden}; new layers and units start with zero output projections)")
  _atomic_dir(path, lambda tmp: save_pretrained(model, tmp))
  log(f"[base] done in {time.perf_counter() - t0:.1f} s, cached at {path}")
  return path


def build_draft_head(cfg: ExperimentConfig, policy, tokenizer, task, log=print):
  """Offline EAGLE-3 initialisation on the policy's rollouts (in-domain: the RL task's prompts;
  general: `general_prompts`, word-like text), cached under cache_dir."""
  from specjax.eagle.checkpoint import load_head, save_head
  from specjax.eagle.train import DraftTrainConfig, train_draft_head
  from specjax.rl.rollout import sampling_config

  d = cfg.draft_init
  graphdef, params = nnx.split(policy)
  # the rollouts' sampling settings, not the engine's (compaction, train widths, the draft
  # lengths it may pick): those do not change what the head is trained on
  key = _digest("draft", d, cfg.rl.draft.kind, cfg.rl.draft.ttt_steps,
                sampling_config(cfg.rl, tokenizer), cfg.rl.task, policy.cfg, _fingerprint(params))
  path = os.path.join(cfg.cache_dir, f"eagle3-{key}")
  if os.path.isdir(path) and not cfg.fresh:
    log(f"[draft] cached EAGLE-3 head {path}")
    return load_head(os.path.abspath(path), policy.cfg)
  toks, lens = _in_domain_prompts(cfg, tokenizer, task)
  t0 = time.perf_counter()
  log(f"[draft] training an EAGLE-3 head on {len(toks)} {d.domain} rollouts ({d.steps} steps)")
  warmup = min(20, max(d.steps // 5, 1), d.steps - 1)  # a short run is not mostly warmup
  train_cfg = DraftTrainConfig(steps=d.steps, batch_size=d.batch_size, learning_rate=d.lr,
                               warmup_steps=warmup, ttt_steps=cfg.rl.draft.ttt_steps,
                               draft_vocab=d.draft_vocab or None, seed=cfg.rl.seed)
  head = None
  if d.head_mlp_hidden:
    from specjax.eagle.head import init_head

    check(d.draft_vocab > 0, "DraftInitConfig.draft_vocab",
          "set it with head_mlp_hidden (the head is built before the vocabulary is counted)")
    head = init_head(policy.cfg.replace(mlp_hidden=d.head_mlp_hidden), d.draft_vocab,
                     seed=cfg.rl.seed)
  target = draft_init_target(cfg, policy, log=log)
  result = train_draft_head(nnx.split(target), toks, lens, head=head,
                            sampling=sampling_config(cfg.rl, tokenizer), config=train_cfg)
  last = result.history[-1]
  log(f"[draft] done in {time.perf_counter() - t0:.1f} s: TTT loss {last['loss']:.3f}, "
      f"step-0 top-1 agreement {last.get('acc_0', float('nan')):.2f}")
  _atomic_dir(path, lambda tmp: save_head(os.path.abspath(tmp), result.head, result.maps))
  return load_head(os.path.abspath(path), policy.cfg)


def draft_init_target(cfg: ExperimentConfig, policy, log=print):
  """The decoder the EAGLE-3 head is trained against offline: a grown base policy's exact
  pre-growth part (`grow.shrink_decoder`: the layers up to the last feature layer, the pretrained
  MLP units; same features, logits and rollouts, several times cheaper per step), else the
  policy itself."""
  small = pretrain_model_cfg(policy.cfg, cfg.base) if not cfg.model_path else policy.cfg
  if small is policy.cfg:
    return policy
  from specjax.experiment.grow import shrink_decoder

  layers = max(max(policy.cfg.aux_layer_ids) + 1, small.num_layers)
  target = shrink_decoder(policy, layers, small.mlp_hidden)
  if target is None:
    return policy
  log(f"[draft] training against the policy's exact {target.cfg.num_params() / 1e6:.2f}M-parameter "
      f"pre-growth part ({layers} layers, MLP {small.mlp_hidden})")
  return target


def _fingerprint(params) -> float:
  """A cheap content key of a policy's params (cache keys): the sum of its first leaves."""
  import jax

  return float(sum(float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(params)[:8]))


def _in_domain_prompts(cfg: ExperimentConfig, tokenizer, task):
  """(tokens, lengths) of the offline-draft prompts (`DraftInitConfig.domain`)."""
  from specjax.rl.rollout import pad_prompts

  d = cfg.draft_init
  if d.domain == "in-domain":
    prompts = [task.encode_prompt(e) for e in task.examples(10_000_000, d.prompts)]
  else:
    prompts = general_prompts(tokenizer, d.prompts, cfg.rl.seed)
  toks, lens, _ = pad_prompts(prompts, max(len(p) for p in prompts), tokenizer.pad_id)
  return np.asarray(toks), np.asarray(lens)


def build_mtp_module(cfg: ExperimentConfig, policy, tokenizer, task, log=print):
  """Offline MTP training: the policy's MTP module alone (trunk frozen) on the policy's rollouts
  of the draft-init prompts; the trained module is cached under cache_dir. Returns the policy."""
  import jax
  from safetensors.numpy import load_file, save_file

  from specjax.eagle.train import collect_rollouts
  from specjax.experiment.pretrain import LmTrainConfig, train_lm
  from specjax.rl.rollout import sampling_config

  d = cfg.draft_init
  trunk = nnx.state(policy, nnx.Not(nnx.PathContains("mtp")))
  key = _digest("mtp", d, sampling_config(cfg.rl, tokenizer), cfg.rl.task, policy.cfg,
                _fingerprint(trunk))
  path = os.path.join(cfg.cache_dir, f"mtp-{key}")
  file = os.path.join(path, "mtp.safetensors")
  if not (os.path.isfile(file) and not cfg.fresh):
    toks, lens = _in_domain_prompts(cfg, tokenizer, task)
    t0 = time.perf_counter()
    log(f"[draft] training the MTP module on {len(toks)} {d.domain} rollouts ({d.steps} steps)")
    sampling = sampling_config(cfg.rl, tokenizer)
    rollouts = collect_rollouts(policy, toks, lens, jax.random.PRNGKey(cfg.rl.seed), sampling,
                                batch_size=d.batch_size)
    train_cfg = LmTrainConfig(steps=d.steps, batch_size=d.batch_size, learning_rate=d.lr,
                              warmup_steps=min(20, d.steps - 1), mtp_only=True, seed=cfg.rl.seed)
    trained, history = train_lm(policy, rollouts.tokens, rollouts.loss_mask, train_cfg,
                                progress=cfg.rl.progress)
    log(f"[draft] done in {time.perf_counter() - t0:.1f} s: MTP loss {history[-1]['loss']:.3f}, "
        f"top-1 accuracy {history[-1].get('mtp_acc', float('nan')):.2f}")
    flat = {"/".join(map(str, p)): np.asarray(jax.device_get(v.get_value()))
            for p, v in nnx.to_flat_state(nnx.state(trained, nnx.PathContains("mtp")))}
    _atomic_dir(path, lambda tmp: save_file(flat, os.path.join(tmp, "mtp.safetensors")))
  else:
    log(f"[draft] cached MTP module {path}")
  saved = load_file(file)
  state = nnx.state(policy, nnx.PathContains("mtp"))
  for p, v in nnx.to_flat_state(state):
    v.set_value(jax.numpy.asarray(saved["/".join(map(str, p))], v.get_value().dtype))
  nnx.update(policy, state)
  return policy


@dataclasses.dataclass(frozen=True)
class _OfflineEnv:
  """The driver's side of `specjax.sampling.methods.OfflineEnv`."""

  cfg: ExperimentConfig
  tokenizer: Any
  task: Any
  policy_dir: str
  log: Callable[[str], None]

  @property
  def draft_model_layers(self) -> int:
    return self.cfg.draft_init.draft_model_layers

  def train_eagle3(self, policy):
    return build_draft_head(self.cfg, policy, self.tokenizer, self.task, log=self.log)

  def train_mtp(self, policy):
    return build_mtp_module(self.cfg, policy, self.tokenizer, self.task, log=self.log)


def build_offline_draft(cfg: ExperimentConfig, policy, tokenizer, task, policy_dir: str,
                        log=print):
  """The draft the RL runs start from, as the draft method builds it (`OfflineDraft`)."""
  env = _OfflineEnv(cfg, tokenizer, task, policy_dir, log)
  return cfg.rl.draft.method.offline_draft(cfg.rl.draft, policy, env)


def export_outputs(cfg: ExperimentConfig, rl_cfg: RLConfig, policy_graphdef, state, draft,
                   log=print) -> dict[str, str]:
  """--export-hf: the run's final policy as a Hugging Face directory (config and tokenizer files
  of --model-path kept) and, for a draft that trains (EAGLE-3), the draft in its serving format
  in a subdirectory named after the method."""
  from specjax.models.export import export_hf

  method = rl_cfg.draft.method
  policy = nnx.merge(policy_graphdef, method.forward_params(state.params))
  out = {"policy": export_hf(policy, cfg.export_hf, source_dir=cfg.model_path or None)}
  log(f"[export] final policy -> {out['policy']}")
  head = method.save_draft(os.path.join(out["policy"], method.name), params=state.params,
                           draft_aux=state.draft_aux, draft=draft)
  if head is not None:
    out["draft"] = head
    log(f"[export] {method.name} draft -> {head}")
  return out


def run_modes(cfg: ExperimentConfig) -> list[tuple[str, RLConfig]]:
  """(label, RL config) of each run: the AR baseline and the speculative run, same seed/data."""
  spec = cfg.rl
  ar = dataclasses.replace(spec, draft=dataclasses.replace(spec.draft, kind="none", online=False))
  if not spec.draft.speculative:
    return [("ar", ar)]
  return [("ar", ar), ("spec", spec)] if cfg.compare else [("spec", spec)]


def run_experiment(cfg: ExperimentConfig, *, base_examples: Examples,
                   finetune_examples: Examples | None = None, log=print) -> dict[str, Any]:
  """All stages; returns the summary written to <out_dir>/<name>/summary.json."""
  import jax
  import jax.numpy as jnp

  from specjax.experiment.report import write_report

  t_start = time.perf_counter()
  out = os.path.join(cfg.out_dir, cfg.name)
  check_flags(cfg)
  claim_run_dir(out, resume=cfg.resume, fresh=cfg.fresh)
  check_export_dir(cfg)
  if cfg.model_path:
    check_model_dir(cfg.model_path)
  tokenizer = build_tokenizer(cfg)
  task = build_task(cfg, tokenizer)
  policy_dir = base_policy_dir(cfg, tokenizer, task, base_examples, finetune_examples, log=log)
  check_model_dir(policy_dir)
  policy = load_base_policy(cfg, tokenizer, policy_dir, log=log)
  check_policy(cfg, policy.cfg, tokenizer, cfg.model_path or policy_dir)
  offline = build_offline_draft(cfg, policy, tokenizer, task, policy_dir, log=log)
  policy, head, maps = offline.policy, offline.draft, offline.draft_maps
  initial = initial_validation(cfg, policy, tokenizer, task, log=log)
  results, final = {}, None
  modes = run_modes(cfg)
  paths = {label: run_paths(out, label, rl_cfg) for label, rl_cfg in modes}
  # every check passed: only now may --fresh move the earlier run aside (deleted at the end)
  replaced = Replacement([out] + [d for p in paths.values()
                                  for d in (p.checkpoint_dir, p.log_dir)], log) \
      if cfg.fresh else None
  os.makedirs(out, exist_ok=True)
  runs = {}
  for i, (label, rl_cfg) in enumerate(modes):
    log(f"[rl:{label}] {rl_cfg.steps} GRPO steps, rollouts by "
        f"{'AR decoding' if label == 'ar' else f'{rl_cfg.draft.kind} K={rl_cfg.draft.draft_len}'}")
    rl_cfg = dataclasses.replace(
        rl_cfg, log_dir=paths[label].log_dir, checkpoint=dataclasses.replace(
            rl_cfg.checkpoint, resume=cfg.resume, dir=paths[label].checkpoint_dir))
    graphdef, params = nnx.split(policy)
    if i < len(modes) - 1:  # the train step donates its state: later runs need the originals
      params = jax.tree.map(jnp.copy, params)
    runs[label] = (rl_cfg, graphdef, params)
  summaries = run_arms(cfg, runs, tokenizer, task, head, maps, paths, log)
  for label, (rl_cfg, graphdef, _) in runs.items():
    run_dir = paths[label].run_dir
    summary = summaries[label]
    state = summary.pop("state", None)
    results[label] = summary
    final = (rl_cfg, graphdef, state, head if label == "spec" else None)
    saved = rl_cfg.draft.method.save_draft(os.path.join(run_dir, "draft_hf"),
                                           params=state.params, draft_aux=state.draft_aux,
                                           draft=final[3]) if state is not None else None
    if saved:
      log(f"[rl:{label}] trained {rl_cfg.draft.kind} draft (serving format) -> {saved}")
  if cfg.export_hf and final is not None:  # the last run: the speculative one, or the only one
    export_outputs(cfg, *final, log=log)
  report = write_report(cfg, out, results, wall_s=time.perf_counter() - t_start, initial=initial)
  if replaced is not None:
    replaced.commit()
  return report


def run_arms(cfg: ExperimentConfig, runs: dict, tokenizer, task, head, maps, paths,
             log=print) -> dict[str, dict]:
  """Each arm's RL run ({label: (RL config, graphdef, params)}) -> {label: its summary}: one
  after the other, or (sync RL, `ExperimentConfig.interleave`) a step of each in turn."""
  def kwargs(label):
    return dict(out_dir=paths[label].run_dir, draft=head if label == "spec" else None,
                draft_maps=maps if label == "spec" else None, verbose=True)

  if cfg.async_rl.enabled:
    from specjax.rl.async_rl.loop import run_rl_async
    return {label: run_rl_async(c, cfg.async_rl, (g, p), tokenizer, task, **kwargs(label))
            for label, (c, g, p) in runs.items()}
  from specjax.rl.loop import drain, iterate_rl

  steps = {label: iterate_rl(c, (g, p), tokenizer, task, **kwargs(label))
           for label, (c, g, p) in runs.items()}
  if not cfg.interleave or len(steps) == 1:
    return {label: drain(s) for label, s in steps.items()}
  log(f"[rl] arms interleaved: a step of each in turn ({', '.join(steps)})")
  summaries, live = {}, list(steps)
  try:
    while live:
      for label in list(live):
        try:
          next(steps[label])
        except StopIteration as done:
          summaries[label] = done.value
          live.remove(label)
  finally:  # an error in one arm: the other saves and closes as on an interruption
    for s in steps.values():
      s.close()
  return {label: summaries[label] for label in runs}


def check_export_dir(cfg: ExperimentConfig) -> None:
  """Fail before any run when --export-hf names a non-empty directory or the source checkpoint."""
  if not cfg.export_hf:
    return
  target = os.path.abspath(cfg.export_hf)
  check(not cfg.model_path or target != os.path.abspath(cfg.model_path),
        "ExperimentConfig.export_hf", f"must differ from --model-path ({cfg.model_path})")
  check(not (os.path.isdir(target) and os.listdir(target)), "ExperimentConfig.export_hf",
        f"{cfg.export_hf} exists and is not empty; choose a new directory")
  check(not os.path.exists(target) or os.path.isdir(target), "ExperimentConfig.export_hf",
        f"{cfg.export_hf} exists and is not a directory")


def initial_validation(cfg: ExperimentConfig, policy, tokenizer, task, log=print) -> dict:
  """The base policy's validation score (step 0), with the loop's own validation code."""
  import jax
  from specjax.rl.loop import setup_run, validate

  if not cfg.rl.validation.every:
    return {}
  ar_cfg = run_modes(cfg)[0][1]
  run, state = setup_run(ar_cfg, nnx.split(policy), tokenizer, task)
  out = validate(run, state, jax.random.fold_in(jax.random.PRNGKey(cfg.rl.seed), 1_000_000))
  log(f"[base] validation accuracy {out.get('val/accuracy', float('nan')):.3f} on "
      f"{cfg.rl.validation.num_prompts} held-out prompts")
  return out
