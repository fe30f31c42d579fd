"""experiments/peer_torch_gpu.py: specjax's decode step beside compiled transformers on the same
checkpoint. The peer side needs torch and transformers (not specjax dependencies): its smoke run
here is skipped where they are absent; the script itself must load and answer --help without
them."""

import json
import os
import subprocess
import sys

import pytest

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "experiments")
SCRIPT = os.path.join(EXPERIMENTS, "peer_torch_gpu.py")


def test_the_script_imports_and_answers_help_without_torch():
  code = (f"import sys; sys.path.insert(0, {EXPERIMENTS!r}); import peer_torch_gpu; "
          "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", code], check=True, env=env)
  out = subprocess.run([sys.executable, SCRIPT, "--help"], check=True, env=env,
                       capture_output=True, text=True).stdout
  assert "--torch-compile" in out and "--budget-s" in out


def test_smoke_runs_both_sides_on_one_checkpoint_and_their_greedy_tokens_agree(tmp_path):
  """Both sides at every batch, ms per step from each, and the greedy tokens compared: in float32
  on the same weights they must agree token for token."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  sys.path.insert(0, EXPERIMENTS)
  import peer_torch_gpu

  out, work = tmp_path / "peer.json", tmp_path / "work"
  res = peer_torch_gpu.main(["--smoke", "--device", "cpu", "--out", str(out),
                             "--work-dir", str(work)])
  data = json.loads(out.read_text())
  assert data["partial"] is False and not data["errors"] and not data["skipped"]
  assert data["args"]["dtype"] == "float32" and data["torch_compile"] == "eager"  # stated
  assert data["comparison"] == res["comparison"]
  rows = data["comparison"]["smoke"]
  assert [r["batch"] for r in rows] == [1, 2]
  for r in rows:
    assert r["specjax_step_ms"] > 0 and r["torch_step_ms"] > 0, r
    assert r["specjax_over_torch"] == pytest.approx(r["specjax_step_ms"] / r["torch_step_ms"])
    g = r["greedy"]
    assert g["compared_tokens"] == 8 and g["rows"] == r["batch"]
    assert g["equal_tokens"] == g["total_tokens"] == 8 * r["batch"], g
    assert g["first_diff"] == [None] * r["batch"] and g["logprob_max_abs_diff"] < 1e-4
  for side in ("specjax", "torch"):
    (done,) = data[side].values()
    assert [row["steps"] for row in done["rows"]] == [7, 7]  # the prefill gives 1 of 8 tokens
  assert all(row["repeat_tokens_equal"] for row in data["torch"]["smoke"]["rows"])
  # the one checkpoint both read, kept under --work-dir with the marker that lets a rerun reuse it
  ckpt = data["checkpoints"]["smoke"]
  assert not ckpt["reused"] and os.path.isfile(os.path.join(ckpt["path"], "config.json"))
  assert os.path.isfile(os.path.join(ckpt["path"], peer_torch_gpu.MARKER))
  print(peer_torch_gpu.table(data))
