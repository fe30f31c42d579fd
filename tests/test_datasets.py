"""Math datasets through the `datasets` library: JSONL, JSON, parquet, save_to_disk directories and
the local hub cache layout give the same rows; missing columns name the source and the columns."""

import json
import os

import pytest

from specjax.errors import UserError
from specjax.rl.tasks.math_data import load_math_dataset

ROWS = [{"question": f"what is {i} plus 1 ?", "answer": f"{i} plus 1 . #### {i + 1}"}
        for i in range(4)]
DAPO = [{"prompt": [{"role": "user", "content": "6*7?"}],
         "reward_model": {"ground_truth": "42", "style": "rule"}}]


@pytest.fixture()
def cache(tmp_path):
  return str(tmp_path / "arrow-cache")


def _answers(path, cache, **kw):
  return [r.answer for r in load_math_dataset(str(path), cache_dir=cache, **kw)]


def _jsonl(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_jsonl_json_and_parquet_files_give_the_same_rows(tmp_path, cache):
  import datasets

  want = ["1", "2", "3", "4"]
  assert _answers(_jsonl(tmp_path / "d.jsonl", ROWS), cache) == want
  (tmp_path / "d.json").write_text(json.dumps(ROWS))
  assert _answers(tmp_path / "d.json", cache) == want
  datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "d.parquet"))
  rows = load_math_dataset(str(tmp_path / "d.parquet"), cache_dir=cache)
  assert [r.answer for r in rows] == want and rows[2].where.endswith("d.parquet:3")


def test_save_to_disk_directories_load_with_their_split(tmp_path, cache):
  import datasets

  datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
  assert _answers(tmp_path / "one", cache) == ["1", "2", "3", "4"]
  dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                             "test": datasets.Dataset.from_list(ROWS[3:])})
  dd.save_to_disk(str(tmp_path / "dict"))
  assert _answers(tmp_path / "dict", cache) == ["1", "2", "3"]
  assert _answers(tmp_path / "dict", cache, split="test") == ["4"]
  with pytest.raises(ValueError, match=r"has splits \['test', 'train'\], not 'validation'"):
    load_math_dataset(str(tmp_path / "dict"), split="validation", cache_dir=cache)


def test_the_local_hub_cache_layout_is_read_from_the_snapshot_refs_main_names(tmp_path, cache):
  import datasets

  repo = tmp_path / "hub" / "datasets--openai--gsm8k"
  snap = repo / "snapshots" / "abc123"
  (snap / "main").mkdir(parents=True)
  datasets.Dataset.from_list(ROWS[:3]).to_parquet(str(snap / "main" / "train-00000-of-00001.parquet"))
  datasets.Dataset.from_list(ROWS[3:]).to_parquet(str(snap / "main" / "test-00000-of-00001.parquet"))
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text("abc123")
  (repo / "snapshots" / "old").mkdir()
  assert _answers(repo, cache) == ["1", "2", "3"]
  assert _answers(repo, cache, split="test") == ["4"]
  # a second configuration (gsm8k ships "main" and "socratic") must be chosen by path
  (snap / "socratic").mkdir()
  datasets.Dataset.from_list(ROWS).to_parquet(str(snap / "socratic" / "train-00000-of-00001.parquet"))
  with pytest.raises(ValueError, match=r"several configurations.*main.*socratic"):
    load_math_dataset(str(repo), cache_dir=cache)
  assert _answers(snap / "socratic", cache) == ["1", "2", "3", "4"]


def test_dapo_rows_keep_their_chat_messages_through_arrow(tmp_path, cache):
  rows = load_math_dataset(str(_jsonl(tmp_path / "dapo.jsonl", DAPO)), cache_dir=cache)
  assert rows[0].answer == "42" and rows[0].messages == ({"role": "user", "content": "6*7?"},)


@pytest.mark.parametrize("rows,fmt,message", [
    ([{"title": "x", "body": "y"}], "auto",
     r"d\.jsonl: missing column 'question' \(GSM8K\) or 'prompt' \(DAPO\); columns present: "
     r"\['body', 'title'\]"),
    ([{"question": "q"}], "gsm8k", r"d\.jsonl: missing column 'answer' \(gsm8k format needs "
                                   r"\['question', 'answer'\]\); columns present: \['question'\]"),
    (ROWS, "dapo", r"missing column 'prompt'.*columns present: \['answer', 'question'\]"),
])
def test_missing_columns_name_the_file_and_the_columns_present(tmp_path, cache, rows, fmt,
                                                              message):
  with pytest.raises(ValueError, match=message):
    load_math_dataset(str(_jsonl(tmp_path / "d.jsonl", rows)), fmt=fmt, cache_dir=cache)


def test_missing_sources_and_unknown_file_types_are_named(tmp_path, cache):
  with pytest.raises(UserError, match="nope.jsonl does not exist"):
    load_math_dataset(str(tmp_path / "nope.jsonl"))
  (tmp_path / "d.csv").write_text("a,b\n")
  with pytest.raises(UserError, match=r"d\.csv: unknown file type '\.csv'"):
    load_math_dataset(str(tmp_path / "d.csv"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(UserError, match="no data file"):
    load_math_dataset(str(tmp_path / "empty"))


def test_unreadable_files_name_the_file_and_the_line(tmp_path, cache):
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"question": "x",\n')
  with pytest.raises(UserError, match=rf"^{bad}:3: invalid JSON"):
    load_math_dataset(str(bad), cache_dir=cache)
  listed = tmp_path / "bad.json"
  listed.write_text('[\n  {"question": "x", "answer": "#### 1"},\n  {"question": }\n]')
  with pytest.raises(UserError, match=rf"^{listed}:3: invalid JSON"):
    load_math_dataset(str(listed), cache_dir=cache)
  (tmp_path / "d.parquet").write_bytes(b"PAR1 cut short")
  with pytest.raises(UserError, match=rf"^{tmp_path / 'd.parquet'}: not a readable parquet file"):
    load_math_dataset(str(tmp_path / "d.parquet"), cache_dir=cache)


def test_an_empty_dataset_and_rows_of_the_wrong_shape_are_named(tmp_path, cache):
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(UserError, match=r"empty.jsonl: the dataset has no rows"):
    load_math_dataset(str(tmp_path / "empty.jsonl"), cache_dir=cache)
  for row, message in ((dict(ROWS[0], question={"text": "x"}), "field 'question' must be a string"),
                       (dict(ROWS[0], answer=None), "missing field 'answer'"),
                       ([1, 2], "expected a JSON object, got list")):
    path = _jsonl(tmp_path / "d.jsonl", [ROWS[0], row])
    with pytest.raises(UserError, match=rf"d.jsonl:2: {message}"):
      load_math_dataset(str(path), cache_dir=cache)
  path = _jsonl(tmp_path / "d.jsonl", [dict(ROWS[0], answer=72.0)])  # a number is its text
  with pytest.raises(UserError, match=r"d.jsonl:1: field 'answer' has no '#### <final answer>'"):
    load_math_dataset(str(path), cache_dir=cache)


def test_the_committed_gsm8k_fixture_has_a_dozen_rows():
  path = os.path.join(os.path.dirname(__file__), "fixtures", "gsm8k_tiny.jsonl")
  rows = load_math_dataset(path)
  assert len(rows) == 12 and rows[0].answer == "19" and rows[10].answer == "999"
