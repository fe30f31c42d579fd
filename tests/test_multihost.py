"""Real multi-process runs: 2 local processes x 2 CPU devices joined by jax.distributed into one
4-device mesh. Their sharded forward and KV-cache step, and two steps of the RL loop with an
online EAGLE-3 draft, checkpointed and resumed, must equal the one-device result."""

import importlib.util
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import multihost_rl_worker
from multihost_worker import reference_outputs

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "experiments" / "launch_local.py"
WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
RL_WORKER = Path(__file__).resolve().parent / "multihost_rl_worker.py"
TIMEOUT_S = 150  # the launcher kills its processes at this point; the test waits a little longer
# The RL run on 4 devices in 2 processes vs 1 device differs only in the order of float32
# reductions (sharded matmuls, cross-process psums, the workers' fusions): measured at most 2e-7
# on any parameter after 2 steps and 5e-7 (1e-7 relative) on the losses and gradient norms. One
# Adam step moves a parameter by up to lr = 1e-3, so a skipped or repeated step, or a resume from
# the wrong parameters or optimizer state, is off by far more than PARAM_ATOL (checked: a resume
# with a fresh Adam state is off by 1.3e-3).
PARAM_ATOL = 1e-5
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-6


def _launcher():
  spec = importlib.util.spec_from_file_location("launch_local", LAUNCHER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run_two_processes(worker: Path, out_dir: Path) -> None:
  """`worker out_dir` as 2 processes x 2 CPU devices through the launcher; fails the test with
  the end of their output if they fail or outlive the timeout."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  cmd = [sys.executable, str(LAUNCHER), "-n", "2", "--cpu-devices", "2", "--timeout",
         str(TIMEOUT_S), "--", sys.executable, str(worker), str(out_dir)]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    log, _ = proc.communicate(timeout=TIMEOUT_S + 20)
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGTERM)  # the launcher stops its children on SIGTERM
    try:
      log, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      log, _ = proc.communicate()
    pytest.fail(f"multi-process run did not finish in {TIMEOUT_S + 20} s:\n{log[-4000:]}")
  assert proc.returncode == 0, log[-4000:]


def test_two_processes_compute_the_single_process_result(tmp_path):
  _run_two_processes(WORKER, tmp_path)
  expected = reference_outputs()
  for process_id in (0, 1):
    got = np.load(tmp_path / f"result_p{process_id}.npz")
    for name, e in zip(("full", "step", "k0"), expected):
      np.testing.assert_allclose(got[name], e, atol=1e-5, rtol=0,
                                 err_msg=f"process {process_id}: {name}")


@pytest.mark.slow
def test_two_processes_run_rl_checkpoint_and_resume_like_one_process(tmp_path):
  _run_two_processes(RL_WORKER, tmp_path)
  w = multihost_rl_worker
  expected = w.reference(str(tmp_path / "reference"))  # uninterrupted, one device
  n = len(w.EXACT_METRICS)
  assert list(expected["steps"]) == [1, 2]
  # both groups learn at both steps: the parameters move, so wrong ones would show
  for name in ("grad_norm/policy", "grad_norm/draft"):
    assert np.all(expected["metrics"][:, n + w.CLOSE_METRICS.index(name)] > 0), name
  for process_id in (0, 1):
    got = np.load(tmp_path / f"rl_p{process_id}.npz")
    where = f"process {process_id}"
    # step 1, then a resume from checkpoint 1 for step 2, on parameters split across processes;
    # SIGTERM reached process 0 only, and both stopped after step 1
    assert int(got["stopped"]) == 1, where
    assert list(got["starts"]) == [0, 1] and list(got["steps"]) == [1, 2], where
    assert got["split_leaves"] > 0, where
    # the sampled tokens (hence rewards, lengths, acceptance) are the same
    np.testing.assert_array_equal(got["metrics"][:, :n], expected["metrics"][:, :n],
                                  err_msg=f"{where}: {w.EXACT_METRICS}")
    np.testing.assert_allclose(got["metrics"][:, n:], expected["metrics"][:, n:],
                               rtol=METRIC_RTOL, atol=METRIC_ATOL,
                               err_msg=f"{where}: {w.CLOSE_METRICS}")
    assert len(expected["params"]) == sum(k.startswith("param") for k in got.files)
    for i, e in enumerate(expected["params"]):
      np.testing.assert_allclose(got[f"param{i:03d}"], e, atol=PARAM_ATOL, rtol=0,
                                 err_msg=f"{where}: parameter {i}")


def test_launcher_stops_every_process_when_one_fails():
  out = io.StringIO()
  code = ("import os, sys, time\n"
          "if os.environ['SPECJAX_PROCESS_ID'] == '1': print('bye'); sys.exit(3)\n"
          "time.sleep(60)\n")
  status = _launcher().launch([sys.executable, "-c", code], 2, timeout_s=30, out=out)
  assert status == 3
  assert "[p1] bye" in out.getvalue()


def test_launcher_kills_processes_that_outlive_the_timeout():
  out = io.StringIO()
  status = _launcher().launch([sys.executable, "-c", "import time; time.sleep(60)"], 2,
                              timeout_s=1, out=out)
  assert status == 124
  assert "timeout" in out.getvalue()


def test_launcher_gives_each_process_its_rank_and_a_shared_coordinator():
  env = _launcher().child_env(1, 2, "127.0.0.1:5000", cpu_devices=2)
  assert (env["SPECJAX_PROCESS_ID"], env["SPECJAX_NUM_PROCESSES"]) == ("1", "2")
  assert env["SPECJAX_COORDINATOR"] == "127.0.0.1:5000"
  assert env["XLA_FLAGS"].split().count("--xla_force_host_platform_device_count=2") == 1
  assert "device_count=8" not in env["XLA_FLAGS"]
