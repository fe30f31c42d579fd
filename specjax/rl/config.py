"""The RL experiment config: one tree of frozen dataclasses, validated on construction.

Load with `load_config(yaml_path, cli_args)`: YAML values override the defaults, then dotted CLI
flags (tyro, e.g. `--grpo.group-size 8`) override the YAML.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

from specjax.config_tree import check as _check, load, one_of as _one_of
from specjax.models.config import ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.grpo import GRPOConfig
from specjax.sampling.engine_config import CompileConfig, EngineConfig
from specjax.drafters.methods import DraftMethod, get_method, method_names
from specjax.sharding.mesh import MeshConfig

@dataclasses.dataclass(frozen=True)
class DraftConfig:
  kind: str = "none"
  # K, tokens proposed per speculative step; with the engine's adaptive K
  # (`rollout.engine.adaptive`) the largest K it picks from (unless adaptive.max_draft_len)
  draft_len: int = 3
  # candidates verified per depth: 1 a chain; W > 1 a draft tree, the drafter's W - 1 next most
  # likely tokens tried where its draft is rejected (eagle3, mtp, draft-model; dense or paged KV)
  tree_width: int = 1
  tree_depth: int = 0  # the tree's alternatives at the chain's first tree_depth depths (0: all)
  tree_argmax: bool = False  # a tree's chain of the drafter's most likely tokens, not samples
  online: bool = False  # train the draft inside the RL train step; kinds without an online loss
  # (all but eagle3, mtp) have nothing to train and read it as False
  loss_weight: float = 1.0  # lambda in  loss = GRPO + lambda * draft loss
  ttt_steps: int = 3  # EAGLE-3 training-time-test unroll
  ngram_min: int = 1
  ngram_max: int = 3
  path: str = ""  # checkpoint or HF folder of an offline-trained draft
  # history / eagle3-history: each prompt's most recent completions (`HistoryStore`), kept on
  # the host for at most history_prompts prompts x history_per_prompt completions of
  # history_tokens tokens (0: ngram_max prompt tokens + max_new_tokens), 4 bytes a token, taken
  # as prompts are recorded (GSM8K's 7.5k or DAPO-Math's 17k prompts all fit; each rollout hands
  # the device its own prompts' entries only); a history draft needs a match of at least
  # history_min_match tokens (capped at ngram_max); history_sampled: at a temperature > 0 each
  # history draft is drawn from the entries' votes for what follows its context (a draft
  # distribution the verifier's residual corrects), not the nearest occurrence's token
  history_prompts: int = 32768
  history_per_prompt: int = 4
  history_tokens: int = 0
  history_min_match: int = 2
  history_sampled: bool = False
  # history / eagle3-history: with corpus_slots > 0 (a power of two) the store also keeps a
  # cross-prompt table (`specjax.drafters.corpus`): for every n-gram of corpus_min_match to
  # corpus_ngram_max tokens in any prompt's earlier rollouts, the draft_len tokens that followed
  # its latest occurrence, in corpus_slots hashed entries (corpus_slots x (draft_len + 2) x 4
  # bytes); a row drafts from it where its context matches there longer than in its prompt's own
  # history. 0: no table
  corpus_slots: int = 0
  corpus_min_match: int = 3
  corpus_ngram_max: int = 8

  def __post_init__(self):
    w = "DraftConfig"
    _one_of(self.kind, method_names(), f"{w}.kind")
    _check(self.draft_len >= 1, f"{w}.draft_len", f"must be >= 1, got {self.draft_len}")
    _check(self.tree_width >= 1, f"{w}.tree_width", f"must be >= 1 (1: a chain), got "
           f"{self.tree_width}")
    _check(self.tree_depth >= 0, f"{w}.tree_depth", f"must be >= 0 (0: every depth), got "
           f"{self.tree_depth}")
    _check(self.loss_weight >= 0, f"{w}.loss_weight", f"must be >= 0, got {self.loss_weight}")
    _check(self.ttt_steps >= 1, f"{w}.ttt_steps", f"must be >= 1, got {self.ttt_steps}")
    _check(1 <= self.ngram_min <= self.ngram_max, f"{w}.ngram_min",
           f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
    _check(self.history_prompts >= 1, f"{w}.history_prompts",
           f"must be >= 1, got {self.history_prompts}")
    _check(self.history_per_prompt >= 1, f"{w}.history_per_prompt",
           f"must be >= 1, got {self.history_per_prompt}")
    _check(self.history_tokens == 0 or self.history_tokens > self.ngram_max,
           f"{w}.history_tokens", f"must be 0 (ngram_max + max_new_tokens) or > ngram_max = "
           f"{self.ngram_max}, got {self.history_tokens}")
    _check(self.corpus_slots >= 0 and not self.corpus_slots & (self.corpus_slots - 1),
           f"{w}.corpus_slots", f"must be 0 (no table) or a power of two, got "
           f"{self.corpus_slots}")
    _check(1 <= self.corpus_min_match <= self.corpus_ngram_max, f"{w}.corpus_min_match",
           f"must be in [1, corpus_ngram_max={self.corpus_ngram_max}], got "
           f"{self.corpus_min_match}")
    _check(self.history_min_match >= 1, f"{w}.history_min_match",
           f"must be >= 1, got {self.history_min_match}")
    if self.online and self.method.online_loss is None:
      # "adapt the draft online when the kind can": switching --rl.draft.kind away from eagle3 /
      # mtp keeps working; only kinds with an online loss ever train inside the step
      object.__setattr__(self, "online", False)

  @property
  def method(self) -> DraftMethod:
    """The registered draft method named by `kind`."""
    return get_method(self.kind)

  @property
  def speculative(self) -> bool:
    return self.method.speculative


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  temperature: float = 1.0
  top_k: int = 0  # 0 disables
  top_p: float = 1.0
  max_new_tokens: int = 64
  # prompts are padded (or left-cut) to this width; 0 -> the task's max_prompt_len if it has one,
  # else each batch's longest prompt rounded up to 32 (set it for datasets: fewer compilations)
  max_prompt_len: int = 0
  gen_dtype: str = ""  # "" -> the policy's own dtype (colocated: the very same arrays)
  # the rollout engine (`specjax.sampling.engine_config`: the queue, paged KV memory, buckets
  # and windows, adaptive K, calibration, compilation), every field a YAML key and a CLI flag
  # (`--rl.rollout.engine.queue.max-rows 64`). An RL run compiles every bucket's programs before
  # the first rollout's first segment (compile.ahead), so no later step compiles and its rollout
  # time is steps only (the engine's own default, for one-off calls: each bucket's when a
  # rollout first reaches it, a faster first rollout)
  engine: EngineConfig = EngineConfig(compile=CompileConfig(ahead=True))
  # the target's KV memory as a share (> 0, instead of engine.paging.kv_cache_gb) of the device
  # memory still free at the first rollout (after the weights and the train state), fixed for
  # the rest of the run
  kv_cache_fraction: float = 0.0
  # the adaptive engine's step costs: measured once per program, bucket and K, then read from the
  # machine's cost cache (a JSON file; "": $SPECJAX_COST_CACHE or ~/.cache/specjax/
  # engine_costs.json; "off": none, each run measures its own); a run reads it once, at its
  # start, and keeps its costs in <run>/engine_costs.json and every checkpoint, so one seed gives
  # one trajectory and a resumed run reads what it read (engine.calibration.cost_memory > 0
  # refines them by the rollouts' own timings: K then follows the machine's load)
  cost_cache: str = ""

  # old paths of the engine's fields, which RolloutConfig mirrored, with their new ones
  MOVED_FIELDS: ClassVar[dict[str, str]] = {
      **{name: f"engine.queue.{name}" for name in ("max_rows", "refill_fraction",
                                                   "refill_from_costs")},
      **{name: f"engine.paging.{name}" for name in ("kv_cache_gb", "page_size")},
      **{name: f"engine.buckets.{name}" for name in ("compaction", "min_bucket", "window_block")},
      "compile_ahead": "engine.compile.ahead",
      **{name: f"engine.calibration.{name}" for name in ("cost_memory", "recheck_cached_costs")},
  }

  def __post_init__(self):
    w = "RolloutConfig"
    _check(self.temperature >= 0, f"{w}.temperature", f"must be >= 0, got {self.temperature}")
    _check(self.top_k >= 0, f"{w}.top_k", f"must be >= 0, got {self.top_k}")
    _check(0 < self.top_p <= 1, f"{w}.top_p", f"must be in (0, 1], got {self.top_p}")
    _check(self.max_new_tokens >= 1, f"{w}.max_new_tokens",
           f"must be >= 1, got {self.max_new_tokens}")
    _check(self.max_prompt_len >= 0, f"{w}.max_prompt_len",
           f"must be >= 0, got {self.max_prompt_len}")
    _one_of(self.gen_dtype, ("", "float32", "bfloat16", "float16"), f"{w}.gen_dtype")
    _check(0 <= self.kv_cache_fraction < 1, f"{w}.kv_cache_fraction",
           f"must be in [0, 1) (0: engine.paging.kv_cache_gb decides), got "
           f"{self.kv_cache_fraction}")
    _check(not (self.kv_cache_fraction and self.engine.paging.kv_cache_gb),
           f"{w}.kv_cache_fraction",
           f"set it or engine.paging.kv_cache_gb, not both (got {self.kv_cache_fraction} and "
           f"{self.engine.paging.kv_cache_gb} GiB)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """How the train step reads a rollout batch: its layout (packed rows or a cut width), which
  sequences it leaves out and the temperature of its logprobs (the optimizers: `RLConfig`)."""

  # the trainer's logprobs use logits / RolloutConfig.temperature, like the sampler's (else the
  # logits as they are)
  temperature: bool = True
  # the train batch is cut to its longest row (prompt + completion) rounded up to
  # width_block * 2^j tokens (while that saves a quarter of the full prompt + max_new_tokens
  # width), not the full width: long-tailed completions train at the width they use. The first
  # step compiles the train step at every width; 0 trains at the full width. Used only when the
  # batch is not packed (below)
  width_block: int = 64
  # sequence packing: the train step lays the rollouts' sequences end to end in rows of
  # pack_width positions (0: prompt + max_new_tokens), each attending only to itself, and sums
  # the gradients of micro-batches of pack_rows rows (rounded up to a multiple of the
  # data-parallel size) before one update: it computes on about as many positions as there are
  # tokens, with one compiled program for every batch. Not with an online draft loss (its head
  # reads one sequence per row): that trains on the batch cut to its longest row
  packing: bool = True
  pack_width: int = 0  # positions per packed row (0: prompt + max_new_tokens)
  pack_rows: int = 1  # packed rows per micro-batch (rounded up to the data-parallel size)
  # the packed train step leaves out the sequences whose every advantage is exactly 0 (a GRPO
  # group whose samples all scored the same) when nothing else in the loss reads them (beta ==
  # 0): their gradient is exactly zero and the loss keeps the whole batch's denominators, so the
  # update is the same up to float summation order. Token-mean metrics (entropy, ratios, clip
  # fractions, sampler mismatch) are then over the sequences trained on
  skip_zero_advantage: bool = True

  def __post_init__(self):
    w = "TrainConfig"
    _check(self.width_block >= 0, f"{w}.width_block",
           f"must be >= 0 (0: the full width), got {self.width_block}")
    _check(self.pack_width >= 0, f"{w}.pack_width",
           f"must be >= 0 (0: prompt + max_new_tokens), got {self.pack_width}")
    _check(self.pack_rows >= 1, f"{w}.pack_rows", f"must be >= 1, got {self.pack_rows}")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  name: str = "arithmetic"  # a key of specjax.rl.tasks.TASKS
  # arithmetic; word_problems: operands - 1 steps over quantities of at most `digits` digits
  digits: int = 1
  operands: int = 2
  operators: str = "+"
  # datasets (gsm8k / dapo / math): local JSONL or parquet
  path: str = ""
  val_path: str = ""
  format: str = "auto"  # auto | gsm8k | dapo
  chat_template: bool = True  # use the tokenizer's chat template when it has one
  system_prompt: str = ""
  instruction: str = ""  # appended to each question (e.g. "put the final answer in \\boxed{}")
  reward_timeout_s: float = 5.0
  format_reward: float = 0.0  # bonus for a well-formed answer, added to the correctness reward
  dataset: str = ""  # reasoning_gym: the procedural dataset's name (e.g. "chain_sum")
  dataset_size: int = 10000
  val_size: int = 64
  seed: int = 0
  # training prompts: 0 = the task's own order (endless for the procedural tasks, epochs over a
  # dataset); N > 0 = a pool of the first N, revisited epoch after epoch, each in a fresh order
  pool_size: int = 0

  def __post_init__(self):
    w = "TaskConfig"
    _check(self.digits >= 1, f"{w}.digits", f"must be >= 1, got {self.digits}")
    _check(self.operands >= 2, f"{w}.operands", f"must be >= 2, got {self.operands}")
    _check(len(self.operators) >= 1 and set(self.operators) <= set("+-*"), f"{w}.operators",
           f"must be a non-empty subset of '+-*', got {self.operators!r}")
    _one_of(self.format, ("auto", "gsm8k", "dapo"), f"{w}.format")
    _check(self.reward_timeout_s > 0, f"{w}.reward_timeout_s",
           f"must be > 0, got {self.reward_timeout_s}")
    _check(self.format_reward >= 0, f"{w}.format_reward", f"must be >= 0, got {self.format_reward}")
    _check(self.val_size >= 0, f"{w}.val_size", f"must be >= 0, got {self.val_size}")
    _check(self.pool_size >= 0, f"{w}.pool_size", f"must be >= 0, got {self.pool_size}")


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
  every: int = 0  # steps between validations; 0 disables
  num_prompts: int = 64
  greedy: bool = True  # greedy decoding; else sampled at the rollout temperature
  batch_size: int = 64

  def __post_init__(self):
    w = "ValidationConfig"
    _check(self.every >= 0, f"{w}.every", f"must be >= 0, got {self.every}")
    _check(self.num_prompts >= 1, f"{w}.num_prompts", f"must be >= 1, got {self.num_prompts}")
    _check(self.batch_size >= 1, f"{w}.batch_size", f"must be >= 1, got {self.batch_size}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When a run saves: every `every` steps and every `every_minutes` of wall time (whichever
  comes first; a hard kill loses at most that much), on exit, and on a stop signal (the step in
  flight finishes first; `specjax.rl.preemption`)."""

  every: int = 0  # steps between checkpoints; 0: none by step count
  every_minutes: float = 20.0  # wall-clock minutes between checkpoints; 0: none by time
  dir: str = ""  # "" -> <out_dir>/checkpoints
  keep: int = 3
  save_on_exit: bool = True
  resume: bool = True  # continue from the latest good checkpoint in `dir`
  # signals that stop the run at the next step boundary with a checkpoint (a second one exits at
  # once); () leaves the process's signal handling alone
  stop_signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1")

  def __post_init__(self):
    w = "CheckpointConfig"
    _check(self.every >= 0, f"{w}.every", f"must be >= 0, got {self.every}")
    _check(self.every_minutes >= 0, f"{w}.every_minutes",
           f"must be >= 0 (0: no checkpoints by wall time), got {self.every_minutes}")
    _check(self.keep >= 1, f"{w}.keep", f"must be >= 1, got {self.keep}")
    import signal
    for name in self.stop_signals:
      full = name if name.startswith("SIG") else f"SIG{name}"
      _check(isinstance(getattr(signal, full, None), int) and not full.startswith("SIG_"),
             f"{w}.stop_signals", f"unknown signal {name!r} (e.g. SIGTERM, SIGINT, SIGUSR1)")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  # the policy's architecture where a driver builds the policy (`specjax.jobs`: --rl.model.*);
  # run_rl and the trainer read the architecture of the policy they are handed
  model: ModelConfig = ModelConfig()
  grpo: GRPOConfig = GRPOConfig()
  policy_optim: OptimConfig = OptimConfig()
  draft_optim: OptimConfig = OptimConfig(lr=1e-4)
  draft: DraftConfig = DraftConfig()
  rollout: RolloutConfig = RolloutConfig()
  train: TrainConfig = TrainConfig()
  task: TaskConfig = TaskConfig()
  validation: ValidationConfig = ValidationConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()
  use_mesh: bool = False  # shard params / optimizer / batch over `mesh`
  steps: int = 100
  prompts_per_step: int = 8
  minibatches: int = 1  # optimizer steps per rollout batch (PPO-style; > 1 makes clipping bite)
  micro_batches: int = 1  # gradient accumulation inside each optimizer step
  seed: int = 0
  # non-finite rewards, advantages, loss or gradients: the step is skipped (parameters unchanged,
  # an event logged) and the run stops after this many bad steps in a row; 0: no skipping (the
  # sync loop then donates the old state to the update, using less memory, and stops at once)
  max_bad_steps: int = 3
  log_dir: str = ""  # "" -> <out_dir>
  progress: bool = True
  tensorboard: bool = True

  # old paths of fields that moved, with their new ones: YAML keys and CLI flags that use an old
  # path fail with a message naming the new one (`specjax.config_tree`)
  MOVED_FIELDS: ClassVar[dict[str, str]] = {
      **{f"rollout.train_{name}": f"train.{name}"
         for name in ("temperature", "width_block", "packing", "pack_width", "pack_rows",
                      "skip_zero_advantage")},
      "draft.adaptive": "rollout.engine.adaptive.enabled",
      **{f"draft.{name}": f"rollout.engine.adaptive.{name}"
         for name in ("max_draft_len", "draft_lens")}}

  def __post_init__(self):
    w = "RLConfig"
    _check(self.steps >= 0, f"{w}.steps", f"must be >= 0, got {self.steps}")
    _check(self.prompts_per_step >= 1, f"{w}.prompts_per_step",
           f"must be >= 1, got {self.prompts_per_step}")
    _check(self.minibatches >= 1, f"{w}.minibatches", f"must be >= 1, got {self.minibatches}")
    _check(self.micro_batches >= 1, f"{w}.micro_batches", f"must be >= 1, got {self.micro_batches}")
    _check(self.max_bad_steps >= 0, f"{w}.max_bad_steps", f"must be >= 0, got {self.max_bad_steps}")
    _check(self.rollout_batch % (self.minibatches * self.micro_batches) == 0, f"{w}.micro_batches",
           f"minibatches * micro_batches must divide prompts_per_step * group_size = "
           f"{self.rollout_batch}, got {self.minibatches} * {self.micro_batches}")

  @property
  def rollout_batch(self) -> int:
    return self.prompts_per_step * self.grpo.group_size

  @property
  def packs_train_batch(self) -> bool:
    """The train step packs sequences (TrainConfig.packing, no online draft loss)."""
    return self.train.packing and not self.draft.online

  @property
  def train_cut_block(self) -> int:
    """`TrainConfig.width_block` of the batch the loops hand the trainer: 0 (its full width)
    when packed, so that every packed row has one width."""
    return 0 if self.packs_train_batch else self.train.width_block

  @property
  def optimizer_steps(self) -> int:
    """Optimizer steps of the whole run (the span of the learning-rate schedules)."""
    return self.steps * self.minibatches

  def replace(self, **kw) -> "RLConfig":
    return dataclasses.replace(self, **kw)


def load_config(yaml_path: str | None = None, cli_args: Sequence[str] | None = (),
                base: RLConfig | None = None) -> RLConfig:
  """Defaults (or `base`) <- YAML file <- CLI flags. `cli_args=None` reads sys.argv."""
  return load(RLConfig, yaml_path, cli_args, base)
