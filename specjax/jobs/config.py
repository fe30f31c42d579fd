"""The experiment's one config tree (base policy, offline draft, RL, async RL, run directory) and
its loading from defaults <- YAML <- CLI flags.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from specjax.config_tree import check, one_of, parse_args
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
  warmup_steps: int = 10  # of pretraining and of fine-tuning (at most their steps - 1)
  finetune_steps: int = 0  # rl_think: extra SFT steps on scratchpad text on top of the base
  # Fraction of training answers replaced by a systematic mistake (off by one): the base policy
  # then prefers a wrong answer but keeps the right one in its distribution, which RL can find.
  bias: float = 0.0
  # Pretrain a smaller decoder, then grow it function-preservingly to --rl.model
  # (`specjax.jobs.grow`): this many layers and MLP units (0: --rl.model's own). A policy
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
    check(self.warmup_steps >= 0, f"{w}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
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
  # keep XLA's compiled programs in <cache_dir>/xla (unless JAX_COMPILATION_CACHE_DIR names
  # another place), so a rerun or a resumed run loads what its first rollout compiled
  compile_cache: bool = True
  # an existing <out_dir>/<name> is refused unless one of these says what to do with it
  fresh: bool = False  # start over: replace the earlier run (once the new one's checks pass) and
  #                      rebuild the cached base policy and draft head
  resume: bool = False  # continue both runs from their own last checkpoints
  # a local Hugging Face checkpoint directory or GGUF file (skips base pretraining)
  model_path: str = ""
  # a local math set (GSM8K or DAPO rows): JSON/JSONL/parquet or a datasets dir, visited whole
  # epoch after epoch (the embedded task's prompt pool does not carry over; `--rl.task.name math
  # --rl.task.path FILE --rl.task.pool-size N` revisits its first N prompts instead)
  dataset: str = ""
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
  # a wall-clock budget in seconds for the whole experiment (0: none): once it is spent, both RL
  # runs end after the step they are at (the same step: the check is made between rounds of a
  # step of each), each after at least two steps (the first compiles), and the report is
  # written as at the end. Sync RL with interleaved arms only
  budget_s: float = 0.0
  base: BaseModelConfig = BaseModelConfig()
  draft_init: DraftInitConfig = DraftInitConfig()
  rl: RLConfig = RLConfig()
  async_rl: AsyncConfig = AsyncConfig()

  def __post_init__(self):
    check(bool(self.name) and os.sep not in self.name, "ExperimentConfig.name",
          f"must be a plain directory name, got {self.name!r}")
    check(self.budget_s >= 0, "ExperimentConfig.budget_s",
          f"must be >= 0 (0: no budget), got {self.budget_s}")
    check(not self.budget_s or (self.interleave and not self.async_rl.enabled),
          "ExperimentConfig.budget_s", "applies to sync RL with interleaved arms (--interleave, "
          "async RL off), where both runs can stop after the same step")


def parse_config(defaults: ExperimentConfig, argv: Sequence[str] | None = None) -> ExperimentConfig:
  """defaults <- YAML (`--config file.yaml`, nested like the dataclasses) <- CLI flags (tyro)."""
  import tyro

  return parse_args(defaults, argv, config=(tyro.conf.AvoidSubcommands,),
                    description="AR vs speculative GRPO on one task (see README).")
