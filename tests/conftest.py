"""Tests run on CPU with 8 fake devices (set before jax is imported anywhere). The repository root
is importable so that tests can use the scaffolding in `experiments/` (`from experiments import toy`)."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drop every compiled program after each test module: one process runs the whole suite, and
  the rollout engine compiles a program per (bucket, draft length), so memory would only grow."""
  yield
  jax.clear_caches()
