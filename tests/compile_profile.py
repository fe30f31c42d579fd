"""Where the test suite's time goes: a pytest plugin that counts, per test, the programs XLA
compiled and the seconds it took (JAX's backend-compile events, summed over threads), by program
name; each process writes one JSON file, and this module run as a script prints the table.

  python -m pytest -p tests.compile_profile --compile-profile runs/compile_profile -n 2 tests
  python tests/compile_profile.py runs/compile_profile

A program named after a primitive (`jit(add)`) or `jit(<unnamed function>)` is one compiled op by
op: a model or a jnp expression called outside jit (counted apart as `eager`)."""

import collections
import glob
import json
import os
import sys
import threading
import time

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_current = {"test": None}
_tests: dict = {}  # nodeid -> {"wall_s", "compile_s", "programs", "by_name": {name: [s, n]}}


def _eager(name: str) -> bool:
  inner = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
  return inner == "<unnamed function>" or inner.startswith("_") or inner.isidentifier() and (
      inner in _PRIMITIVES)


_PRIMITIVES = {"add", "multiply", "subtract", "divide", "broadcast_in_dim", "concatenate",
               "transpose", "reshape", "dynamic_slice", "dynamic_update_slice", "gather", "scatter",
               "rsqrt", "split", "convert_element_type", "iota", "select_n", "dot_general", "exp",
               "tanh", "equal", "squeeze", "slice", "remainder", "integer_pow", "max", "min",
               "reduce_max", "reduce_sum", "argmax", "cumsum", "log", "logistic", "sqrt", "pad",
               "unstack", "ravel", "clamp", "ne", "lt", "gt", "sign", "abs", "neg"}


def _listener(event: str, duration: float, **kwargs) -> None:
  test = _current["test"]
  if event != _EVENT or test is None:
    return
  name = kwargs.get("fun_name") or "?"
  with _lock:
    rec = _tests.setdefault(test, {"wall_s": 0.0, "compile_s": 0.0, "programs": 0, "by_name": {}})
    rec["compile_s"] += duration
    rec["programs"] += 1
    by = rec["by_name"].setdefault(name, [0.0, 0])
    by[0] += duration
    by[1] += 1


def pytest_addoption(parser):
  parser.addoption("--compile-profile", default="", metavar="DIR",
                   help="write each process's compile profile (JSON) into DIR")


def pytest_configure(config):
  if config.getoption("--compile-profile"):
    from jax._src import monitoring
    monitoring.register_event_duration_secs_listener(_listener)


def pytest_runtest_logstart(nodeid, location):
  _current["test"] = nodeid
  with _lock:
    _tests.setdefault(nodeid, {"wall_s": 0.0, "compile_s": 0.0, "programs": 0, "by_name": {}})
    _tests[nodeid]["start"] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
  with _lock:
    rec = _tests.get(nodeid)
    if rec is not None and "start" in rec:
      rec["wall_s"] = time.perf_counter() - rec.pop("start")
  _current["test"] = None


def pytest_sessionfinish(session):
  out = session.config.getoption("--compile-profile")
  if not out or not _tests or session.config.pluginmanager.hasplugin("dsession"):
    return  # (pytest-xdist's controller runs no test: its workers write theirs)
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, f"compile-profile-{worker or 'main'}-{os.getpid()}.json")
  with open(f"{path}.tmp", "w") as f:
    json.dump(_tests, f, indent=1)
  os.replace(f"{path}.tmp", path)


def summarize(directory: str, top: int = 15) -> dict:
  """Per file and per program name, over every process's JSON in `directory`."""
  files = collections.defaultdict(lambda: {"wall_s": 0.0, "compile_s": 0.0, "programs": 0,
                                           "eager_s": 0.0, "eager_programs": 0, "tests": 0})
  names = collections.defaultdict(lambda: [0.0, 0])
  for path in sorted(glob.glob(os.path.join(directory, "compile-profile-*.json"))):
    with open(path) as f:
      for nodeid, rec in json.load(f).items():
        row = files[nodeid.split("::")[0]]
        row["tests"] += 1
        row["wall_s"] += rec["wall_s"]
        row["compile_s"] += rec["compile_s"]
        row["programs"] += rec["programs"]
        for name, (s, n) in rec["by_name"].items():
          names[name][0] += s
          names[name][1] += n
          if _eager(name):
            row["eager_s"] += s
            row["eager_programs"] += n
  total = {k: sum(r[k] for r in files.values()) for k in
           ("tests", "wall_s", "compile_s", "programs", "eager_s", "eager_programs")}
  return {"total": total, "files": dict(files),
          "programs": {k: {"compile_s": s, "count": n} for k, (s, n) in
                       sorted(names.items(), key=lambda kv: -kv[1][0])[:top]}}


def main(argv: list[str]) -> None:
  if len(argv) != 1 or not os.path.isdir(argv[0]):
    sys.exit("usage: python tests/compile_profile.py DIR  (the --compile-profile directory)")
  s = summarize(argv[0])
  print(f"{'file':44s} {'tests':>5s} {'wall s':>8s} {'compile s':>9s} {'programs':>8s} "
        f"{'eager s':>7s} {'eager':>6s}")
  rows = sorted(s["files"].items(), key=lambda kv: -kv[1]["wall_s"]) + [("all", s["total"])]
  for name, r in rows:
    print(f"{name:44s} {r['tests']:5d} {r['wall_s']:8.1f} {r['compile_s']:9.1f} "
          f"{r['programs']:8d} {r['eager_s']:7.1f} {r['eager_programs']:6d}")
  print(f"\n{'program':44s} {'compile s':>9s} {'count':>6s}")
  for name, r in s["programs"].items():
    print(f"{name:44s} {r['compile_s']:9.1f} {r['count']:6d}")
  with open(os.path.join(argv[0], "summary.json"), "w") as f:
    json.dump(s, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
