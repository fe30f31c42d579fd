"""Tasks and verifiers: the arithmetic generator, GSM8K / DAPO-Math loaders with file:line errors,
chat templates, math-verify rewards under a timeout (a worker process off the main thread), the
registry."""

import json
import os
import threading

import numpy as np
import pytest

from specjax.errors import UserError
from specjax.models import CharTokenizer, HFTokenizer
from specjax.rl.config import TaskConfig
from specjax.rl.tasks import Example, Score, compute_rewards, make_task
from specjax.rl.tasks.arithmetic import ArithmeticTask, evaluate
from specjax.rl.tasks.trace import LONG_LABELS, TraceTask, trace_text
from specjax.rl.tasks.math_data import (FALLBACK_TEMPLATE, MathDatasetTask, load_math_dataset,
                                        render_chat)
from specjax.rl.tasks import rewards
from specjax.rl.tasks.rewards import exact_answer_reward, extract_answer, math_verify_reward
from specjax.rl.verify_worker import (CallFailed, CallTimeout, TimedWorker, WorkerDied,
                                      WorkerStartError)

TOK = CharTokenizer()


def test_arithmetic_examples_are_deterministic_and_follow_the_difficulty_knobs():
  task = ArithmeticTask(TaskConfig(digits=2, operands=3, operators="+-*", seed=7), TOK)
  a, b = task.examples(10, 5), task.examples(10, 5)
  assert a == b and task.example(12) == a[2]
  assert a != ArithmeticTask(TaskConfig(digits=2, operands=3, operators="+-*", seed=8),
                             TOK).examples(10, 5)
  for ex in task.examples(0, 200):
    xs, ops = ex.meta["operands"], ex.meta["operators"]
    assert len(xs) == 3 and all(0 <= x < 100 for x in xs) and set(ops) <= set("+-*")
    assert ex.prompt.endswith("=") and int(ex.answer) == evaluate(xs, ops)
    assert len(task.encode_prompt(ex)) <= task.max_prompt_len
    assert len(ex.answer) <= task.max_answer_len
  assert evaluate([2, 3, 4], ["+", "*"]) == 14 and evaluate([9, 3, 2], ["-", "-"]) == 4
  assert task.validation(4) == task.validation(4) and task.validation(4) != task.examples(0, 4)


def test_arithmetic_reward_is_exact_match_with_an_optional_format_bonus():
  ex = Example(prompt="12+7=", answer="19")
  plain = ArithmeticTask(TaskConfig(), TOK)
  assert plain.score("19", ex) == Score(1.0, True)
  assert plain.score(" 19 ", ex) == Score(1.0, True)
  assert plain.score("18", ex) == Score(0.0, False)
  bonus = ArithmeticTask(TaskConfig(format_reward=0.1), TOK)
  assert bonus.score("19", ex).reward == pytest.approx(1.1)
  assert bonus.score("18", ex).reward == pytest.approx(0.1)
  assert bonus.score("1a", ex).reward == 0.0


def _write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def test_trace_task_writes_a_recurrence_counting_down_to_a_with_long_tailed_lengths():
  assert trace_text(3, 5, 4) == "d3+5=8,c5+8=3,b8+3=1,a3+1=4#4"
  task = TraceTask(TaskConfig(name="trace", operands=24), TOK)
  exs = task.examples(0, 2000)
  assert exs == task.examples(0, 2000) and task.validation(8) != task.examples(0, 8)
  lengths = []
  for ex in exs[:300]:
    whole = ex.prompt + task.scratchpad(ex)
    steps = ex.meta["steps"]
    assert 2 <= steps <= 24 and whole.count("=") == steps and whole.endswith("#" + ex.answer)
    a, b = int(ex.prompt[1]), int(ex.prompt[3])
    assert whole == trace_text(a, b, steps)
    assert len(task.encode_prompt(ex)) <= task.max_prompt_len
  for ex in exs:
    lengths.append(len(TOK.encode(task.scratchpad(ex), eos=True)))
  assert max(lengths) <= task.max_completion_len
  p10, p50, p90 = np.percentile(lengths, [10, 50, 90])
  assert p10 < 20 and p50 < 0.3 * task.max_completion_len < p90  # long-tailed
  ex = exs[0]
  good = task.scratchpad(ex)
  assert task.score(good, ex).correct
  wrong = good.rsplit("#", 1)[0] + "#" + str((int(ex.answer) + 1) % 10)
  assert not task.score(wrong, ex).correct and not task.score("no answer", ex).correct
  with pytest.raises(ValueError, match="TaskConfig.operands"):
    TraceTask(TaskConfig(name="trace", operands=27), TOK)



def test_long_trace_counts_two_letter_labels_down_to_aa_with_completions_past_a_thousand_tokens():
  assert trace_text(3, 5, 3, LONG_LABELS) == "ac3+5=8,ab5+8=3,aa8+3=1#1"
  task = make_task(TaskConfig(name="trace-long", operands=129), TOK)
  exs = task.examples(0, 3000)
  lengths = [len(TOK.encode(task.scratchpad(ex), eos=True)) for ex in exs]
  longest = exs[int(np.argmax(lengths))]
  assert max(lengths) == task.max_completion_len >= 1024  # the longest trace of 129 steps
  assert longest.meta["steps"] == 129 and longest.prompt.startswith("ey")
  assert np.median(lengths) < 0.15 * max(lengths)  # long-tailed
  for ex in exs[:200]:
    a, b = int(ex.prompt[2]), int(ex.prompt[4])
    assert ex.prompt + task.scratchpad(ex) == trace_text(a, b, ex.meta["steps"], LONG_LABELS)
    assert len(task.encode_prompt(ex)) <= task.max_prompt_len
    assert task.score(task.scratchpad(ex), ex).correct
  with pytest.raises(UserError, match="TaskConfig.operands: the trace-long task takes 2..676"):
    make_task(TaskConfig(name="trace-long", operands=677), TOK)

def test_gsm8k_rows_load_with_the_final_answer_after_the_hash_marks(tmp_path):
  path = _write_jsonl(tmp_path / "gsm8k.jsonl", [
      {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
      {"question": "Big?", "answer": "lots\n#### 1,200"}])
  rows = load_math_dataset(path, instruction="Answer in \\boxed{}.")
  assert [r.answer for r in rows] == ["7", "1200"]
  assert rows[0].messages == ({"role": "user",
                               "content": "Tom has 3 apples and buys 4. How many?\n"
                                          "Answer in \\boxed{}."},)
  assert rows[1].where.endswith("gsm8k.jsonl:2")


def test_dapo_rows_load_from_jsonl_and_parquet_with_chat_message_prompts(tmp_path):
  row = {"data_source": "math_dapo", "ability": "MATH",
         "prompt": [{"role": "user", "content": "Compute 6*7. Answer: $Answer"}],
         "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"},
         "extra_info": {"index": "a1"}}
  rows = load_math_dataset(_write_jsonl(tmp_path / "dapo.jsonl", [row]), system_prompt="Be brief.")
  assert rows[0].answer == "42"
  assert rows[0].messages[0] == {"role": "system", "content": "Be brief."}
  assert rows[0].messages[1]["content"].startswith("Compute 6*7")
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist([row, dict(row, reward_model={"ground_truth": "7"})]),
                 tmp_path / "dapo.parquet")
  rows = load_math_dataset(str(tmp_path / "dapo.parquet"), fmt="dapo")
  assert [r.answer for r in rows] == ["42", "7"] and rows[1].where.endswith("dapo.parquet:2")


@pytest.mark.parametrize("bad,message", [
    ({"question": "no answer here"}, "missing field 'answer'"),
    ({"question": "q", "answer": "no marker"}, "field 'answer' has no '#### <final answer>'"),
    ({"prompt": "q", "reward_model": {"style": "x"}}, "missing field 'reward_model.ground_truth'"),
    ({"prompt": [{"text": "q"}], "reward_model": {"ground_truth": "1"}}, "field 'prompt' must be"),
    ({"title": "neither"}, "missing field 'question' \\(GSM8K\\) or 'prompt' \\(DAPO\\)"),
    ("{not json", "invalid JSON"),
])
def test_a_malformed_row_fails_with_file_and_line(tmp_path, bad, message):
  good = {"question": "1+1?", "answer": "#### 2"}
  path = _write_jsonl(tmp_path / "data.jsonl", [good, good, bad])
  with pytest.raises(ValueError, match=f"data.jsonl:3: {message}"):
    load_math_dataset(path)


def _hf_tokenizer(tmp_path, template):
  from tokenizers import Tokenizer, models, pre_tokenizers

  words = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "what", "is", "2+2?", "system:", "hi"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(str(tmp_path / "tokenizer.json"))
  cfg = {"eos_token": "<eos>"}
  if template:
    cfg["chat_template"] = template
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return HFTokenizer(str(tmp_path))


def test_prompts_use_the_tokenizers_chat_template_when_it_has_one(tmp_path):
  template = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
  data = _write_jsonl(tmp_path / "d.jsonl", [{"question": "what is 2+2?", "answer": "#### 4"}] * 3)
  (tmp_path / "tok").mkdir()
  tok = _hf_tokenizer(tmp_path / "tok", template)
  task = MathDatasetTask(TaskConfig(name="gsm8k", path=data, val_size=1), tok)
  ex = task.example(0)
  assert ex.prompt == "<|user|> what is 2+2? <|assistant|>"
  assert tok.decode(task.encode_prompt(ex), skip_control=False) == \
      "<|user|> what is 2+2? <|assistant|>"
  assert len(task.rows) == 2 and len(task.validation(5)) == 1
  # without a template (or with chat_template=False): the documented fallback format
  plain = MathDatasetTask(TaskConfig(path=data, val_size=1, chat_template=False), tok)
  assert plain.example(0).prompt == "User: what is 2+2?\n\nAssistant:"
  assert render_chat([{"role": "user", "content": "x"}], None) == \
      render_chat([{"role": "user", "content": "x"}], FALLBACK_TEMPLATE)


def test_dataset_order_is_a_fresh_permutation_per_epoch_and_deterministic(tmp_path):
  rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(6)]
  data = _write_jsonl(tmp_path / "d.jsonl", rows)
  task = MathDatasetTask(TaskConfig(path=data, val_size=0, chat_template=False), TOK)
  epoch0 = [task.example(i).answer for i in range(6)]
  epoch1 = [task.example(i).answer for i in range(6, 12)]
  assert sorted(epoch0) == sorted(epoch1) == [str(i) for i in range(6)]
  again = MathDatasetTask(TaskConfig(path=data, val_size=0, chat_template=False), TOK)
  assert [again.example(i).answer for i in range(12)] == epoch0 + epoch1


def test_answer_extraction_prefers_boxed_then_answer_lines_then_the_last_number():
  assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
  assert extract_answer("work...\nAnswer: 34.") == "34"
  assert extract_answer("blah #### 1,000") == "1,000"
  assert extract_answer("it is 3 then 5") == "5"
  assert extract_answer("no digits") is None
  assert exact_answer_reward("The total is \\boxed{1,200}", "1200") == 1.0
  assert exact_answer_reward("The total is 12.0", "12") == 1.0
  assert exact_answer_reward("The total is 13", "12") == 0.0


def test_math_verify_reward_accepts_equivalent_answers_and_never_raises():
  assert math_verify_reward("Thus the answer is $\\boxed{\\frac{1}{2}}$.", "0.5") == 1.0
  assert math_verify_reward("Answer: 72", "72") == 1.0
  assert math_verify_reward("\\boxed{71}", "72") == 0.0
  assert math_verify_reward("\\boxed{\\frac{", "72") == 0.0  # malformed LaTeX
  assert math_verify_reward("", "\\sqrt{2}") == 0.0


def _alive(pid):
  return os.path.exists(f"/proc/{pid}")  # a process not reaped yet (a zombie) still has an entry


HANGS = "$\\boxed{9^{9^{9^{9}}}}$"  # sympy computes with the number: math-verify never returns


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_math_verify_reward_off_the_main_thread_scores_in_a_worker_process_that_leaks_nothing():
  out = []

  def rollout_thread():  # math-verify's own timeouts need the main thread: a worker process here
    out.append(math_verify_reward("\\boxed{72}", "72"))
    out.append(math_verify_reward("\\boxed{71}", "72"))
    for _ in range(2):
      out.append(math_verify_reward(HANGS, "1", timeout_s=0.2))
    out.append(math_verify_reward("Thus the answer is $\\boxed{\\frac{1}{2}}$.", "0.5"))

  threads, restarts = threading.active_count(), rewards._verifier().restarts
  caller = threading.Thread(target=rollout_thread)
  caller.start()
  caller.join()
  assert out == [1.0, 0.0, 0.0, 0.0, 1.0]
  assert threading.active_count() == threads
  verifier = rewards._verifier()
  assert verifier.restarts == restarts + 2  # one fresh process per timeout
  pid = verifier.pid
  rewards.close_verifier()
  assert verifier.pid is None and not _alive(pid)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_timed_out_calls_kill_and_replace_the_worker_process_and_leave_no_thread_behind():
  worker = TimedWorker("time:sleep")
  assert worker.call(0, timeout=30) is None  # started: the start is not counted in a timeout
  threads = threading.active_count()
  for _ in range(5):
    stuck = worker.pid
    with pytest.raises(CallTimeout, match="did not return within 0.2 s"):
      worker.call(60, timeout=0.2)
    assert not _alive(stuck) and worker.pid != stuck  # killed, reaped and replaced at once
    assert threading.active_count() == threads
  assert worker.call(0, timeout=30) is None  # the replacement answers
  with pytest.raises(CallFailed, match="TypeError"):  # a call that raises keeps its process
    worker.call("soon", timeout=30)
  last = worker.pid
  assert worker.call(0, timeout=30) is None and worker.pid == last
  worker.close()
  assert worker.pid is None and not _alive(last) and threading.active_count() == threads


def test_a_worker_process_that_dies_during_a_call_is_reported_and_replaced():
  worker = TimedWorker("os:_exit")
  with pytest.raises(WorkerDied, match=r"died during the call \(exit code 3\)"):
    worker.call(3, timeout=30)
  assert worker.restarts == 1 and worker.pid is not None
  worker.close()


def test_a_worker_process_that_cannot_start_is_an_error_not_a_zero_score():
  worker = TimedWorker("specjax.no_such_module:check")
  with pytest.raises(WorkerStartError, match="could not start: ModuleNotFoundError"):
    worker.call("x", timeout=5)
  assert worker.pid is None


def test_a_scorer_that_raises_gives_reward_zero_and_an_error_message():
  def score(text, ex):
    if text == "boom":
      raise ZeroDivisionError("bad verifier")
    return Score(float(text == ex.answer), text == ex.answer)

  ex = Example(prompt="1+1=", answer="2")
  batch = compute_rewards(score, ["2", "boom", "3"], [ex, ex, ex])
  np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.0])
  np.testing.assert_array_equal(batch.correct, [True, False, False])
  assert len(batch.errors) == 1 and "ZeroDivisionError: bad verifier" in batch.errors[0]


def test_the_registry_builds_tasks_by_name_and_rejects_unknown_ones(tmp_path):
  assert isinstance(make_task(TaskConfig(name="arithmetic"), TOK), ArithmeticTask)
  with pytest.raises(ValueError, match="TaskConfig.name"):
    make_task(TaskConfig(name="chess"), TOK)
  with pytest.raises(ValueError, match="TaskConfig.path"):
    make_task(TaskConfig(name="gsm8k"), TOK)
  with pytest.raises(ValueError, match="TaskConfig.operators"):
    TaskConfig(operators="/")
  try:
    import reasoning_gym  # noqa: F401
  except ImportError:
    with pytest.raises(ImportError, match="pip install reasoning-gym"):
      make_task(TaskConfig(name="reasoning_gym", dataset="chain_sum"), TOK)


def test_a_prompt_pool_is_revisited_every_epoch_in_a_fresh_order():
  tok = CharTokenizer()
  pooled = TraceTask(TaskConfig(name="trace", operands=6, pool_size=5), tok)
  stream = TraceTask(TaskConfig(name="trace", operands=6), tok)
  first = [e.prompt for e in stream.examples(0, 5)]
  epochs = [[e.prompt for e in pooled.train_examples(5 * i, 5)] for i in range(3)]
  for epoch in epochs:
    assert sorted(epoch) == sorted(first)  # every epoch: the pool's five prompts, once each
  assert len({tuple(e) for e in epochs}) > 1  # in an order drawn per epoch
  # any window of positions reads the same prompts (a resumed run sees what it would have seen)
  assert [e.prompt for e in pooled.train_examples(3, 6)] == (epochs[0] + epochs[1])[3:9]
  # without a pool, RL reads the stream; the pool never changes the task's own stream
  assert [e.prompt for e in stream.train_examples(5, 5)] == \
      [e.prompt for e in stream.examples(5, 5)] == [e.prompt for e in pooled.examples(5, 5)]


def _story_value(question: str) -> int:
  """The answer of a generated word problem, recomputed from its text."""
  import re

  value = None
  for sentence in question.split(". "):
    nums = [int(x) for x in re.findall(r"\d+", sentence)]
    if " has " in sentence and value is None:
      value = nums[0]
    elif "buys" in sentence:
      value += nums[0]
    elif "gives" in sentence:
      value -= nums[0]
    elif "times as many" in sentence:
      value *= nums[0]
  return value


def test_word_problems_are_deterministic_stories_whose_answer_is_their_arithmetic(tmp_path):
  from specjax.rl.tasks.math_data import load_math_dataset
  from specjax.rl.tasks.word_problems import WordProblemTask, write_jsonl

  cfg = TaskConfig(name="word_problems", operands=3, digits=2, operators="+-*")
  task = make_task(cfg, CharTokenizer())
  assert isinstance(task, WordProblemTask)
  train, val = task.examples(0, 200), task.validation(50)
  assert [e.prompt for e in train] == [e.prompt for e in task.examples(0, 200)]
  assert not {e.prompt for e in train} & {e.prompt for e in val}
  for e in train + val:
    question = e.meta["question"]
    assert question in e.prompt and "####" in e.prompt
    assert question.count(". ") == 2 + 1  # the start, two steps, then the question
    assert int(e.answer) == _story_value(question) > 0
  assert {"buys", "gives", "times"} <= {w for e in train for w in e.meta["question"].split()}
  ex = train[0]
  assert task.score(f"So the answer is\n#### {ex.answer}", ex) == Score(1.0, True)
  assert not task.score(f"#### {int(ex.answer) + 1}", ex).correct
  # the same problems as GSM8K rows, for the math dataset task or another engine
  path = write_jsonl(str(tmp_path / "wp.jsonl"), cfg, 0, 20)
  rows = load_math_dataset(path, "gsm8k")
  assert [r.answer for r in rows] == [e.answer for e in train[:20]]
  with pytest.raises(FileExistsError):
    write_jsonl(path, cfg, 0, 20)
