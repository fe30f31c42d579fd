"""Where the test suite's time goes: a pytest plugin that counts, per test, the programs XLA
compiled and the seconds it took, by program name (the engine's process-wide compile listener,
`specjax.sampling.engine.programs.PROGRAMS.by_name`: seconds summed over threads); each process writes one JSON file, and this module run as a script prints the table.

  python -m pytest -p tests.compile_profile --compile-profile runs/compile_profile -n 2 tests
  python tests/compile_profile.py runs/compile_profile

A program named after a primitive (`jit(add)`) or `jit(<unnamed function>)` is one compiled op by
op: a model or a jnp expression called outside jit (counted apart as `eager`)."""

import collections
import glob
import json
import os
import sys
import time

# names JAX gives a lax primitive or a jnp function called outside jit (`jit(add)`, `jit(_where)`)
_PRIMITIVES = {"add", "multiply", "mul", "subtract", "divide", "broadcast_in_dim", "concatenate",
               "transpose", "reshape", "dynamic_slice", "dynamic_update_slice", "gather",
               "scatter", "rsqrt", "split", "convert_element_type", "iota", "select_n",
               "dot_general", "exp", "tanh", "equal", "squeeze", "slice", "remainder",
               "integer_pow", "max", "min", "log", "logistic", "sqrt", "pad", "clamp", "ne",
               "lt", "gt", "sign", "abs", "neg"}


def _eager(name: str) -> bool:
  """A program compiled op by op: unnamed, or named after one primitive or jnp function."""
  inner = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
  return inner == "<unnamed function>" or inner.startswith("_") or inner in _PRIMITIVES


_tests: dict = {}  # nodeid -> {"wall_s", "compile_s", "programs", "by_name": {name: [s, n]}}
_start: dict = {}  # nodeid -> (wall clock, PROGRAMS.by_name as it was)
_profiling = {"on": False}


def _programs():
  from specjax.sampling.engine.programs import PROGRAMS  # (the process's one compile listener)
  PROGRAMS.listen()
  return PROGRAMS


def pytest_addoption(parser):
  parser.addoption("--compile-profile", default="", metavar="DIR",
                   help="write each process's compile profile (JSON) into DIR")


def pytest_runtest_logstart(nodeid, location):
  if _profiling["on"]:
    _start[nodeid] = (time.perf_counter(),
                      {k: tuple(v) for k, v in _programs().by_name.items()})


def pytest_runtest_logfinish(nodeid, location):
  if nodeid not in _start:
    return
  t0, before = _start.pop(nodeid)
  by_name = {}
  for name, (s, n) in list(_programs().by_name.items()):
    s0, n0 = before.get(name, (0.0, 0))
    if n > n0:
      by_name[name] = [s - s0, n - n0]
  _tests[nodeid] = {"wall_s": time.perf_counter() - t0,
                    "compile_s": sum(s for s, _ in by_name.values()),
                    "programs": sum(n for _, n in by_name.values()), "by_name": by_name}


def pytest_configure(config):
  # (pytest-xdist's controller runs no test: its workers profile theirs)
  controller = bool(getattr(config.option, "numprocesses", None)) and \
      not hasattr(config, "workerinput")
  _profiling["on"] = bool(config.getoption("--compile-profile")) and not controller


def pytest_sessionfinish(session):
  out = session.config.getoption("--compile-profile")
  if not out or not _tests:
    return
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, f"compile-profile-{worker}-{os.getpid()}.json")
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
  print(f"\n{'program':44s} {'compile s':>9s} {'count':>6s} {'s each':>6s}")
  for name, r in s["programs"].items():
    print(f"{name:44s} {r['compile_s']:9.1f} {r['count']:6d} {r['compile_s'] / r['count']:6.2f}")
  with open(os.path.join(argv[0], "summary.json"), "w") as f:
    json.dump(s, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
