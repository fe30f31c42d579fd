"""Tests run on CPU with 8 fake devices and XLA flags that compile faster (set before jax is
imported anywhere). The repository root is importable so that tests can use the scaffolding in
`experiments/` (`from experiments import toy`)."""

import importlib.metadata
import logging
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' programs are tiny and compiling them is most of the suite's time: LLVM at -O0 with
# XLA's older CPU fusion emitters compiles the engine's segment programs in about a third of
# -O1's time, and the suite takes about half as long, though kernels run slower in the few tests
# with large batches (docs/BENCHMARKS.md, "Test suite wall time"). The emitter flag is measured
# on jaxlib 0.10, and XLA stops at startup on a flag it does not know, so a later jaxlib runs at
# -O0 alone. A flag the caller set wins.
_TEST_XLA_FLAGS = {"xla_force_host_platform_device_count": "8",
                   "xla_backend_optimization_level": "0"}
if importlib.metadata.version("jaxlib").startswith("0.10."):
  _TEST_XLA_FLAGS["xla_cpu_use_fusion_emitters"] = "false"
_flags = os.environ.get("XLA_FLAGS", "")
for _name, _value in _TEST_XLA_FLAGS.items():
  if _name not in _flags:
    _flags = f"{_flags} --{_name}={_value}"
os.environ["XLA_FLAGS"] = _flags.strip()

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

# One persistent compilation cache per test run, shared by the pytest-xdist workers (they inherit
# this process's environment): `_free_compiled_programs` drops every compiled program after each
# module, and later modules compile many of the same programs (the same tiny models and shapes).
# A run starts with an empty cache, as on a fresh clone, and the process that made it removes it.
_CACHE_ENV = "SPECJAX_TEST_COMPILATION_CACHE"
_OWN_CACHE = _CACHE_ENV not in os.environ and not os.environ.get("JAX_COMPILATION_CACHE_DIR")
if _OWN_CACHE:
  os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="specjax-test-jax-cache-")
if os.environ.get(_CACHE_ENV):
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# RL runs keep the rollout engine's measured step costs in a machine-wide file
# (`specjax.sampling.calibration`): the tests use one of their own, not the user's
_OWN_COSTS = "SPECJAX_COST_CACHE" not in os.environ
if _OWN_COSTS:
  os.environ["SPECJAX_COST_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="specjax-test-costs-"),
                                                  "engine_costs.json")


def pytest_unconfigure(config):
  if _OWN_CACHE:
    shutil.rmtree(os.environ[_CACHE_ENV], ignore_errors=True)
  if _OWN_COSTS:
    shutil.rmtree(os.path.dirname(os.environ["SPECJAX_COST_CACHE"]), ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drop every compiled program after each test module: one process runs the whole suite, and
  the rollout engine compiles a program per (bucket, draft length), so memory would only grow."""
  yield
  jax.clear_caches()


@pytest.fixture(autouse=True)
def _restore_package_logger():
  """A test that runs a script's main in this process leaves the package logger as scripts set it
  (`jobs.console.setup_logging`: its own stdout handler, no propagation), which would hide later
  tests' log lines from pytest's `caplog`: restore it after every test."""
  logger = logging.getLogger("specjax")
  saved = (logger.level, list(logger.handlers), logger.propagate)
  yield
  logger.setLevel(saved[0])
  logger.handlers[:] = saved[1]
  logger.propagate = saved[2]
