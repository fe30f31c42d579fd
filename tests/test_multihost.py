"""A real multi-process run: 2 local processes x 2 CPU devices joined by jax.distributed into one
4-device mesh; their sharded forward and KV-cache step must equal the one-device result."""

import importlib.util
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from multihost_worker import reference_outputs

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "experiments" / "launch_local.py"
WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
TIMEOUT_S = 150  # the launcher kills its processes at this point; the test waits a little longer


def _launcher():
  spec = importlib.util.spec_from_file_location("launch_local", LAUNCHER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_two_processes_compute_the_single_process_result(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  cmd = [sys.executable, str(LAUNCHER), "-n", "2", "--cpu-devices", "2", "--timeout",
         str(TIMEOUT_S), "--", sys.executable, str(WORKER), str(tmp_path)]
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
  expected = reference_outputs()
  for process_id in (0, 1):
    got = np.load(tmp_path / f"result_p{process_id}.npz")
    for name, e in zip(("full", "step", "k0"), expected):
      np.testing.assert_allclose(got[name], e, atol=1e-5, rtol=0,
                                 err_msg=f"process {process_id}: {name}")


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
