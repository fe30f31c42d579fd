"""The real-model path at library level on the committed fixtures: a transformers-made Qwen3 with
its chat template, its community EAGLE-3 head and GSM8K rows -> prompts, lossless speculative
rollouts, math-verify rewards, export, and a reload whose logits match."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters.checkpoint import load_draft_head
from specjax.drafters.eagle3 import eagle3_drafter
from specjax.models.export import export_hf
from specjax.models.hf import load_pretrained, load_tokenizer
from specjax.models.tokenizer import MissingChatTemplateError
from specjax.rl.config import TaskConfig
from specjax.rl.rollout import pad_prompts
from specjax.rl.tasks.math_data import MathDatasetTask
from specjax.sampling import SamplingConfig, generate, speculative_generate

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN3 = os.path.join(FIXTURES, "qwen3_tiny")
HEAD = os.path.join(FIXTURES, "qwen3_tiny_eagle3")
GSM8K = os.path.join(FIXTURES, "gsm8k_tiny.jsonl")


@pytest.fixture(scope="module")
def setup():
  tok = load_tokenizer(QWEN3)
  policy = load_pretrained(QWEN3)
  head, maps = load_draft_head(HEAD, policy.cfg, policy_embed=policy.embed[...])
  task = MathDatasetTask(TaskConfig(name="gsm8k", path=GSM8K, val_size=2), tok)
  return tok, policy, head, maps, task


def test_prompts_go_through_the_checkpoints_chat_template(setup):
  tok, _, _, _, task = setup
  ex = task.example(0)
  assert ex.prompt.startswith("<|im_start|> user ") and ex.prompt.endswith("<|im_start|> assistant ")
  ids = task.encode_prompt(ex)
  assert ids[0] == tok._tok.token_to_id("<|im_start|>")
  assert task.score(f"so the answer is {ex.answer}", ex).correct


def test_a_tokenizer_without_a_template_stops_the_task_unless_chosen():
  llama = os.path.join(FIXTURES, "llama_tiny")
  with pytest.raises(MissingChatTemplateError, match="llama_tiny: no chat template"):
    MathDatasetTask(TaskConfig(path=GSM8K), load_tokenizer(llama, require_chat_template=False))
  plain = MathDatasetTask(TaskConfig(path=GSM8K), load_tokenizer(llama, chat_template="none"))
  assert plain.example(0).prompt.startswith("User: ")


def test_speculative_rollouts_with_the_published_head_equal_autoregressive(setup):
  tok, policy, head, maps, task = setup
  prompts = [task.encode_prompt(e) for e in task.examples(0, 4)]
  toks, lens, _ = pad_prompts(prompts, max(len(p) for p in prompts), tok.pad_id)
  toks, lens = jnp.asarray(toks), jnp.asarray(lens)
  greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
  drafter, params = eagle3_drafter(head, policy.embed[...], maps, draft_len=3)
  ar = generate(policy, toks, lens, jax.random.key(0), greedy)
  spec = speculative_generate(policy, drafter, params, toks, lens, jax.random.key(1), greedy)
  np.testing.assert_array_equal(spec.tokens, ar.tokens)


def test_the_exported_policy_reloads_with_the_same_logits_and_tokenizer(setup, tmp_path):
  tok, policy, _, _, _ = setup
  out = export_hf(policy, str(tmp_path / "export"), source_dir=QWEN3)
  ids = jnp.asarray(np.load(os.path.join(QWEN3, "input_ids.npy")))
  np.testing.assert_array_equal(np.asarray(load_pretrained(out)(ids).logits),
                                np.asarray(policy(ids).logits))
  assert load_tokenizer(out).chat_template == tok.chat_template
