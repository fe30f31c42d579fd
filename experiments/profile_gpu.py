"""Where one decode segment's time goes, as a table: the plain loop's decode step (as in
`bench_gpu.py`'s decode stage) timed without the profiler, then one more call traced with
`jax.profiler.trace`, whose decode segment is summarised per step (kernels, busy time, idle gaps
between kernels, host round trips, the kernels that take the time). Optional XLA flag variants
(command buffers over `while` loops, ...) run as separate rows of the same table, each in its
own process (XLA reads XLA_FLAGS once, when its backend starts).

  python experiments/profile_gpu.py --out runs/profile_gpu.json          # GPU: 1.7B, batch 1, 64
  python experiments/profile_gpu.py --xla-flags-variants default cmdbuf-while cmdbuf-off
  python experiments/profile_gpu.py --smoke --out /tmp/profile.json      # tiny, CPU, seconds
  python experiments/profile_gpu.py --smoke --platform cuda              # the GPU path, tiny

Run it from the repository root; it reuses `bench_gpu.py`'s shapes, model builder, prompts and
timed decode (`decode_row`). Nothing is downloaded; the profiler needs only jaxlib.

Why: at the Qwen3 shapes the decode step takes well over the time its weight reads need, by a
cost that does not grow with depth. Suspects: a `while` loop of unknown trip count, whose
predicate a GPU copies to the host and waits for at every iteration; XLA's command buffers (CUDA
graphs), which leave WHILE and CONDITIONAL out by default; kernel launches; a copy of a donated
buffer inside the loop. The trace tells them apart: round trips show as device-to-host copies
per step (and the host's driver calls around them), launches as idle gaps between kernels, a
copy as a copy kernel's time.

What is measured, per (variant, shape, batch):
- `step_ms`: `bench_gpu.decode_row` (the fastest of --repeats calls after a compiling one; the
  engine's timed decode segment / its steps), no profiler attached.
- one more call under the profiler; its decode segment's steps (`steps`, --new-tokens - 1) divide
  every figure below, and `traced_step_ms` is the segment's time with the profiler attached.
- the segment's window in the trace: from the first to the last event tagged with the segment
  program's module (`jit_run_segment`); the whole trace where no event is tagged.
- `kind` "device": the events on the GPU's stream lines (CUPTI): kernels (count, summed time,
  time by class of name: gemm, triton, fusion, copy, other), memcpy and memset by direction with
  bytes, busy time (the union over streams), idle gaps between them (all, and those over --gap-us,
  count and time), the top --top kernel names by time; `round_trips_per_step`: device-to-host
  copies per step. `kind` "host" (no device stream: the CPU): the same over XLA's op events on the
  host threads (leaf ops; a `while` that holds ops is counted apart as nested).
- host side, either kind: counts per step of driver calls (kernel launches, graph launches,
  device-to-host copies, synchronizations) and executions, and the host event names that take
  the most time in the window.

The trace source: the profile's `.xplane.pb`, read with `jax.profiler.ProfileData` (jaxlib's
own reader; it holds every plane, the CUPTI driver-call plane included); where that cannot be
read, the `perfetto_trace.json.gz` that `jax.profiler.trace(create_perfetto_trace=True)` writes
beside it (its `traceEvents`: complete events, `ph` "X", on processes and threads named by `ph`
"M" events; it holds the host threads and the device planes only).

XLA runs without command buffers while a profiler is attached (its flag
`--xla_enable_command_buffers_during_profiling` is false by default), so a trace would show a
launch mode other than the one timed; every variant's process gets that flag set to true, unless
--trace-op-by-op. The flags parse on every backend (the CPU accepts and ignores the GPU's), and
XLA aborts on an unknown flag or value, so a variant's flags are checked by a smoke run on any
machine. The tracer itself costs time at every launch: gaps in a trace are upper bounds, and
`traced_step_ms` against `step_ms` says by how much the trace ran slower.

JSON (--out) is rewritten after every row with `partial: true`, and at the end without. Raw
traces go to a fresh directory under --trace-dir (default: the system's temporary directory),
removed at the end, or to --keep-traces DIR, kept (open the `.xplane.pb` in TensorBoard's or
XProf's profile tool, the `perfetto_trace.json.gz` at ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import gzip
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import bench_gpu  # noqa: E402  (the repository root and experiments/ on sys.path above)
from bench_gpu import (SHAPES, build_target, decode_row, log, prompts_for,  # noqa: E402
                       write)


# named XLA flag sets, one process each (verified: jaxlib's DebugOptions parser accepts them and
# rejects a misspelt value; XLA's default command buffer types are FUSION, CUBLAS, CUBLASLT,
# CUSTOM_CALL, CUDNN, DYNAMIC_SLICE_FUSION; loops are unrolled into one only with a known count)
VARIANTS = {
    "default": "",
    "cmdbuf-while": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
    "cmdbuf-unroll": ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL "
                      "--xla_gpu_command_buffer_unroll_loops=true"),
    "cmdbuf-off": "--xla_gpu_enable_command_buffer=",
}
# without it, XLA runs op by op (no command buffers) while a profiler is attached
TRACE_CMDBUF_FLAG = "--xla_enable_command_buffers_during_profiling=true"
SEGMENT_MODULE = "jit_run_segment"  # the XLA module of the engine's decode segment
DRAFT_LAYERS = 2  # as bench_gpu's decode stage: later layers add nothing, yet read their weights
ROW, DEVICE, SKIP = "PROFILE_ROW ", "PROFILE_DEVICE ", "PROFILE_SKIP "  # a child's JSON lines
# kernel classes by name, first match wins
CLASSES = (("memcpy", r"memcpy"), ("memset", r"memset"),
           ("gemm", r"gemm|cutlass|cublas|xmma|nvjet|matmul|^dot\b|^dot\."),
           ("triton", r"triton"), ("copy", r"copy|transpose"), ("fusion", r"fusion"))
# host-side counters by event name
HOST_COUNTERS = {
    "kernel_launches": r"^cu(da)?LaunchKernel",
    "graph_launches": r"^cu(da)?GraphLaunch",
    "memcpy_d2h_calls": r"^cu(da)?Memcpy\w*(DtoH|D2H)",
    "memcpy_h2d_calls": r"^cu(da)?Memcpy\w*(HtoD|H2D)",
    "syncs": r"Synchronize",
    "executions": r"Execute",
}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--shapes", nargs="+", default=["qwen3-1.7b"], choices=list(SHAPES))
  p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--repeats", type=int, default=2,
                 help="timed calls after the compiling one (the fastest gives step_ms)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--xla-flags-variants", nargs="+", default=["default"],
                 help=f"rows of XLA flags, each in its own process: a name ({', '.join(VARIANTS)})"
                      " or NAME=FLAGS (space-separated XLA flags, quoted)")
  p.add_argument("--trace-op-by-op", action="store_true",
                 help=f"do not pass {TRACE_CMDBUF_FLAG}: XLA then drops command buffers while "
                      "traced (each kernel is traced under its HLO op)")
  p.add_argument("--gap-us", type=float, default=5.0,
                 help="idle gaps between kernels longer than this are counted apart")
  p.add_argument("--top", type=int, default=5, help="kernel names listed by time")
  p.add_argument("--platform", default=None,
                 help="JAX_PLATFORMS for the measuring processes (default: jax's choice; "
                      "--smoke: cpu)")
  p.add_argument("--budget-s", type=float, default=480.0,
                 help="rows and variants that would start after this many seconds are skipped")
  p.add_argument("--out", default="runs/profile_gpu.json")
  p.add_argument("--trace-dir", default=tempfile.gettempdir(),
                 help="a fresh directory for the raw traces is made here and removed at the end")
  p.add_argument("--keep-traces", default=None, metavar="DIR",
                 help="write the raw traces here instead, and keep them")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shape, batches 1 and 2, 8 new tokens, float32, on the CPU: a check "
                      "that the script runs, not a measurement")
  # set by the parent process for each variant's process
  p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
  p.add_argument("--trace-run-dir", default=None, help=argparse.SUPPRESS)
  if "--smoke" in (sys.argv[1:] if argv is None else argv):  # other defaults; flags still apply
    p.set_defaults(shapes=["smoke"], batches=[1, 2], new_tokens=8, prompt_len=8,
                   dtype="float32", platform="cpu")
  a = p.parse_args(argv)
  for name in ("prompt_len", "new_tokens", "repeats", "top"):
    if getattr(a, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
  if a.new_tokens < 2:
    p.error("--new-tokens must be >= 2 (the prefill emits the first token)")
  if any(b < 1 for b in a.batches):
    p.error("batches must be >= 1")
  try:
    a.variants = [variant_flags(v) for v in a.xla_flags_variants]
  except ValueError as e:
    p.error(str(e))
  names = [n for n, _ in a.variants]
  if len(set(names)) != len(names):
    p.error(f"--xla-flags-variants: names repeat: {names}")
  return a


def variant_flags(spec: str) -> tuple[str, str]:
  """(name, XLA flags) of a --xla-flags-variants entry: a known name or NAME=FLAGS."""
  name, eq, flags = spec.partition("=")
  if not eq:
    if name not in VARIANTS:
      raise ValueError(f"--xla-flags-variants: {name!r} is not one of {', '.join(VARIANTS)} "
                       "(or give NAME=FLAGS)")
    return name, VARIANTS[name]
  if not re.fullmatch(r"[\w.-]+", name):
    raise ValueError(f"--xla-flags-variants: {spec!r}: the name must be letters, digits, _ . -")
  return name, flags.strip()


# ---- reading a trace ---------------------------------------------------------------------------


@dataclasses.dataclass
class Event:
  """One complete event of a trace: its plane (process) and line (thread), times in ns."""
  plane: str
  line: str
  name: str
  start_ns: float
  dur_ns: float
  stats: dict

  @property
  def end_ns(self) -> float:
    return self.start_ns + self.dur_ns


def trace_files(trace_dir: str) -> dict:
  """The files `jax.profiler.trace` wrote under `trace_dir` (its latest session)."""
  sessions = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*")),
                    key=os.path.getmtime)
  if not sessions:
    raise FileNotFoundError(f"no profile session under {trace_dir}")
  files = {}
  for path in glob.glob(os.path.join(sessions[-1], "*")):
    if path.endswith(".xplane.pb"):
      files["xplane"] = path
    elif path.endswith("perfetto_trace.json.gz"):
      files["perfetto"] = path
  return files


def load_xplane(path: str) -> list[Event]:
  """Every event of every plane of an `.xplane.pb`, read with jaxlib's `ProfileData`."""
  from jax.profiler import ProfileData
  data = ProfileData.from_file(path)
  return [Event(plane.name, line.name, e.name, float(e.start_ns), float(e.duration_ns),
                dict(e.stats))
          for plane in data.planes for line in plane.lines for e in line.events]


def load_perfetto(path: str) -> list[Event]:
  """The complete events of a perfetto / Chrome trace JSON (gzipped or not), named by its
  process_name and thread_name metadata events."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    events = json.load(f)
  events = events.get("traceEvents", []) if isinstance(events, dict) else events
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e.get("pid")] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
  return [Event(procs.get(e.get("pid"), str(e.get("pid"))),
                threads.get((e.get("pid"), e.get("tid")), str(e.get("tid"))), e.get("name", ""),
                1e3 * float(e.get("ts", 0.0)), 1e3 * float(e.get("dur", 0.0)),
                dict(e.get("args") or {}))
          for e in events if e.get("ph") == "X"]


def load_trace(trace_dir: str) -> tuple[list[Event], str, dict]:
  """(events, which file they came from, the files): the xplane where jaxlib reads it (it alone
  holds the CUPTI driver-call plane), else the perfetto JSON."""
  files = trace_files(trace_dir)
  errors = []
  if "xplane" in files:
    try:
      return load_xplane(files["xplane"]), "xplane", files
    except Exception as e:  # an older or newer jaxlib without the reader: the JSON still serves
      errors.append(f"xplane: {type(e).__name__}: {e}")
  if "perfetto" in files:
    return load_perfetto(files["perfetto"]), "perfetto", files
  raise FileNotFoundError(f"no readable trace in {trace_dir}: {files} {errors}")


# ---- summarising one segment -------------------------------------------------------------------


def is_device_stream(e: Event) -> bool:
  """An event on a GPU's stream line (kernels, copies, memsets; CUPTI's activity records)."""
  return e.plane.startswith("/device:") and e.line.startswith("Stream")


def is_host_op(e: Event) -> bool:
  """One of XLA's op events on a host thread (the CPU backend runs its ops there)."""
  return (not e.plane.startswith("/device:") and "hlo_op" in e.stats
          and not e.name.startswith("end: "))


def kernel_class(name: str) -> str:
  for cls, pattern in CLASSES:
    if re.search(pattern, name, re.IGNORECASE):
      return cls
  return "other"


def memcpy_direction(e: Event) -> str | None:
  """D2H, H2D, D2D, P2P or other for a copy event; None for anything else."""
  details = str(e.stats.get("memcpy_details", ""))
  if not re.search("memcpy", e.name, re.IGNORECASE) and not details:
    return None
  for direction, pattern in (("D2H", r"D2H|DtoH"), ("H2D", r"H2D|HtoD"), ("D2D", r"D2D|DtoD"),
                             ("P2P", r"P2P|PtoP")):
    if re.search(pattern, e.name):
      return direction
  src = re.search(r"kind_src:(\w+)", details)
  dst = re.search(r"kind_dst:(\w+)", details)
  if src and dst:
    host = ("pinned", "pageable", "host")
    s, d = src.group(1).lower(), dst.group(1).lower()
    on_device = lambda kind: kind.startswith("device")  # device, device_static
    if on_device(s) and d in host:
      return "D2H"
    if s in host and on_device(d):
      return "H2D"
    if on_device(s) and on_device(d):
      return "D2D"
  return "other"


def memcpy_bytes(e: Event) -> int:
  m = re.search(r"size:(\d+)", str(e.stats.get("memcpy_details", "")))
  return int(m.group(1)) if m else 0


def leaves(events: list[Event]) -> tuple[list[Event], list[Event]]:
  """(events holding no other event of their line, events that do: e.g. a `while` op whose body
  ops run inside it)."""
  by_line: dict = {}
  for e in events:
    by_line.setdefault((e.plane, e.line), []).append(e)
  outer = set()
  for line in by_line.values():
    stack: list[Event] = []
    for e in sorted(line, key=lambda e: (e.start_ns, -e.dur_ns)):
      while stack and stack[-1].end_ns <= e.start_ns:
        stack.pop()
      while stack and e.end_ns > stack[-1].end_ns:  # overlapping, not inside: not its parent
        stack.pop()
      if stack:
        outer.add(id(stack[-1]))
      stack.append(e)
  return ([e for e in events if id(e) not in outer], [e for e in events if id(e) in outer])


def busy_intervals(events: list[Event]) -> list[tuple[float, float]]:
  """The union of the events' intervals, sorted."""
  merged: list[list[float]] = []
  for e in sorted(events, key=lambda e: e.start_ns):
    if merged and e.start_ns <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], e.end_ns)
    else:
      merged.append([e.start_ns, e.end_ns])
  return [(lo, hi) for lo, hi in merged]


def segment_window(events: list[Event], module: str = SEGMENT_MODULE) -> tuple[float, float, str]:
  """(start, end, what) of the decode segment in the trace: the span of the events tagged with
  its module (the device is idle before it: the engine waits for the step before); the whole
  trace where none is."""
  tagged = [e for e in events if str(e.stats.get("hlo_module", "")).startswith(module)]
  if not tagged:
    return float("-inf"), float("inf"), "whole trace"
  return min(e.start_ns for e in tagged), max(e.end_ns for e in tagged), "segment"


def summarize(events: list[Event], steps: int, gap_us: float = 5.0, top: int = 5,
              module: str = SEGMENT_MODULE) -> dict:
  """Per decode step: the segment's device stream events (or, with none, XLA's op events on the
  host threads), their busy time and idle gaps, copies by direction, the top names by time, and
  the host's driver calls and event names in the same window."""
  steps = max(int(steps), 1)
  lo, hi, window = segment_window(events, module)
  # what starts inside: the host's last wait for the device may end after the last kernel
  inside = [e for e in events if lo <= e.start_ns <= hi]
  device_total = sum(1 for e in events if is_device_stream(e))
  ops = [e for e in inside if is_device_stream(e)]
  kind = "device" if ops else "host"
  if not ops:
    ops = [e for e in inside if is_host_op(e)]
  ops, nested = leaves(ops)
  per = lambda x: x / steps
  ms = lambda ns: ns / 1e6 / steps
  copies = {}
  kernels = []
  for e in ops:
    direction = memcpy_direction(e) if kind == "device" else None
    if direction is None:
      kernels.append(e)
      continue
    c = copies.setdefault(direction, {"count": 0, "bytes": 0, "ns": 0.0})
    c["count"] += 1
    c["bytes"] += memcpy_bytes(e)
    c["ns"] += e.dur_ns
  busy = busy_intervals(ops)
  gaps = [b[0] - a[1] for a, b in itertools.pairwise(busy)]
  long_gaps = [g for g in gaps if g > 1e3 * gap_us]
  classes: dict = {}
  names: dict = {}
  for e in kernels:
    c = classes.setdefault(kernel_class(e.name), [0, 0.0])
    c[0] += 1
    c[1] += e.dur_ns
    n = names.setdefault(e.name, [0, 0.0])
    n[0] += 1
    n[1] += e.dur_ns
  busy_ns = sum(b - a for a, b in busy)
  ranked = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
  out = {
      "kind": kind, "window": window, "steps": steps,
      "window_ms": (hi - lo) / 1e6 if window == "segment" else None,
      "device_stream_events_in_trace": device_total,
      "events": len(ops), "events_per_step": per(len(ops)),
      "kernels_per_step": per(len(kernels)),
      "nested_per_step": per(len(nested)),  # ops holding others (a while loop), not in events
      "kernel_ms_per_step": ms(sum(e.dur_ns for e in kernels)),
      "busy_ms_per_step": ms(busy_ns),
      "span_ms_per_step": ms(busy[-1][1] - busy[0][0]) if busy else 0.0,
      "gap_ms_per_step": ms(sum(gaps)), "gaps_per_step": per(len(gaps)),
      "gap_threshold_us": gap_us,
      "long_gaps_per_step": per(len(long_gaps)), "long_gap_ms_per_step": ms(sum(long_gaps)),
      "classes": {k: {"per_step": per(n), "ms_per_step": ms(t)}
                  for k, (n, t) in sorted(classes.items(), key=lambda kv: -kv[1][1])},
      "top": [{"name": name[:300], "per_step": per(n), "ms_per_step": ms(t),
               "share_of_busy": t / busy_ns if busy_ns else None}
              for name, (n, t) in ranked],
      "memcpy": {d: {"per_step": per(c["count"]), "bytes_per_step": per(c["bytes"]),
                     "ms_per_step": ms(c["ns"])} for d, c in sorted(copies.items())},
      "round_trips_per_step": (per(copies.get("D2H", {}).get("count", 0))
                               if kind == "device" else None),
  }
  summarised = {id(e) for e in ops} | {id(e) for e in nested}
  host = [e for e in inside if not e.plane.startswith("/device:")
          and not e.name.startswith("end: ") and id(e) not in summarised]
  counters = {k: per(sum(1 for e in host if re.search(p, e.name)))
              for k, p in HOST_COUNTERS.items()}
  host_names: dict = {}
  for e in host:
    n = host_names.setdefault(e.name, [0, 0.0])
    n[0] += 1
    n[1] += e.dur_ns
  out["host"] = {"events_per_step": per(len(host)), "counters_per_step": counters,
                 "top": [{"name": name[:300], "per_step": per(n), "ms_per_step": ms(t)}
                         for name, (n, t) in sorted(host_names.items(),
                                                    key=lambda kv: -kv[1][1])[:2 * top]]}
  return out


# ---- one variant's process ---------------------------------------------------------------------


def emit(prefix: str, record: dict) -> None:
  print(prefix + json.dumps(record), flush=True)


def profile_row(a, shape: str, model, graphdef, params, b: int, bandwidth: float) -> dict:
  """`decode_row`'s timing of the plain loop at batch `b` (its first call compiles), then one more
  call under the profiler, whose decode segment is summarised."""
  import jax
  from specjax.sampling import STATIC, SamplingConfig, generate

  row = {"variant": a.variant, "shape": shape, "xla_flags": os.environ.get("XLA_FLAGS", "")}
  row.update(decode_row(a, model, graphdef, params, b, bandwidth))
  if "error" in row:
    return row
  scfg = SamplingConfig(max_new_tokens=a.new_tokens, temperature=1.0)
  prompts, lengths = prompts_for(b, a.prompt_len, model.cfg.vocab_size, a.seed + b)
  trace_dir = os.path.join(a.trace_run_dir, a.variant, f"{shape}_b{b}")
  try:
    t0 = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      out = generate((graphdef, params), prompts, lengths, jax.random.key(a.repeats + 1), scfg,
                     engine=STATIC)
      jax.block_until_ready(out)
    row["traced_call_s"] = time.perf_counter() - t0  # the profiler's export included
    seg = out.segments[0]
    row["traced_step_ms"] = 1e3 * seg.seconds / max(seg.iterations, 1)
    t0 = time.perf_counter()
    events, source, files = load_trace(trace_dir)
    row["trace"] = summarize(events, seg.iterations, a.gap_us, a.top)
    row["trace"]["kernels_per_step_per_layer"] = (row["trace"]["kernels_per_step"]
                                                  / model.cfg.num_layers)
    row["trace"].update(source=source, parse_s=time.perf_counter() - t0,
                        bytes={k: os.path.getsize(p) for k, p in files.items()})
    if a.keep_traces:
      row["trace"]["files"] = files
  except Exception as e:  # keep the timing and the other rows
    row["trace_error"] = f"{type(e).__name__}: {str(e)[:800]}"
  return row


def log_row(row: dict) -> None:
  label = f"{row['variant']} {row['shape']} batch {row['batch']:4d}"
  if "error" in row or "trace_error" in row:
    log(f"{label}: failed ({(row.get('error') or row['trace_error'])[:300]})")
    return
  t = row["trace"]
  log(f"{label}: {row['step_ms']:.3f} ms/step ({row['traced_step_ms']:.3f} traced), "
      f"{t['kind']} events {t['events_per_step']:.1f}/step busy {t['busy_ms_per_step']:.3f} ms "
      f"gaps {t['gap_ms_per_step']:.3f} ms ({t['long_gaps_per_step']:.1f} over "
      f"{t['gap_threshold_us']:g} us), round trips {fmt(t['round_trips_per_step'], '.1f')}")


def run_variant(a) -> None:
  """One variant's rows, in this process (its XLA_FLAGS set by the parent): JSON lines on
  stdout, which the parent merges."""
  import jax
  from flax import nnx

  info = bench_gpu.device_info()
  info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  emit(DEVICE, info)
  bandwidth = bench_gpu.copy_bandwidth_gbps(16 if a.smoke else 1024)
  log(f"{a.variant}: {info['device_kind']} ({info['platform']}), copy bandwidth "
      f"{bandwidth:.0f} GB/s, XLA_FLAGS={info['xla_flags']!r}")
  for shape in a.shapes:
    if time.perf_counter() - bench_gpu.START > a.budget_s:
      emit(SKIP, {"variant": a.variant, "what": f"{shape} (every batch)"})
      continue
    t0 = time.perf_counter()
    model = build_target(shape, a.dtype, DRAFT_LAYERS, a.seed)
    graphdef, params = nnx.split(model)
    log(f"{shape}: {model.cfg.num_params() / 1e9:.3f}B parameters built in "
        f"{time.perf_counter() - t0:.1f} s")
    for b in a.batches:
      if time.perf_counter() - bench_gpu.START > a.budget_s:
        emit(SKIP, {"variant": a.variant, "what": f"{shape} batch {b}"})
        continue
      row = profile_row(a, shape, model, graphdef, params, b, bandwidth)
      log_row(row)
      emit(ROW, row)
    model = graphdef = params = None
    gc.collect()
    jax.clear_caches()


# ---- the parent: one process per variant, merged -----------------------------------------------


def child_env(a, flags: str) -> dict:
  env = dict(os.environ)
  parts = [env.get("XLA_FLAGS", ""), flags, "" if a.trace_op_by_op else TRACE_CMDBUF_FLAG]
  env["XLA_FLAGS"] = " ".join(p for p in parts if p)
  if a.platform:
    env["JAX_PLATFORMS"] = a.platform
  env["PYTHONUNBUFFERED"] = "1"
  return env


def run_child(a, argv: list[str], name: str, flags: str, trace_root: str, results: dict) -> None:
  """Run one variant's process, echo its log, merge its rows into `results` (written after each),
  record how it ended."""
  left = a.budget_s - (time.perf_counter() - bench_gpu.START)
  cmd = [sys.executable, os.path.abspath(__file__), *argv, "--variant", name,
         "--trace-run-dir", trace_root, "--budget-s", f"{left:.1f}"]
  env = child_env(a, flags)
  rec = {"xla_flags": env["XLA_FLAGS"], "rows": 0}
  results["variants"][name] = rec
  log(f"variant {name}: XLA_FLAGS={env['XLA_FLAGS']!r}")
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1)
  # a row started inside the budget may still compile and trace: past it by this much, stop
  limit = max(left, 0.0) + 300.0
  timer = threading.Timer(limit, proc.kill)
  timer.start()
  tail: list[str] = []
  try:
    for line in proc.stdout:
      line = line.rstrip("\n")
      if line.startswith(ROW):
        row = json.loads(line[len(ROW):])
        results["rows"].append(row)
        rec["rows"] += 1
        write(a, results)
      elif line.startswith(DEVICE):
        rec["device"] = json.loads(line[len(DEVICE):])
        results.setdefault("device", rec["device"])
      elif line.startswith(SKIP):
        results["skipped"].append(json.loads(line[len(SKIP):]))
      else:
        print(f"  [{name}] {line}", flush=True)
        tail = (tail + [line])[-40:]
    rc = proc.wait()
  finally:
    timer.cancel()
  rec.update(rc=rc, seconds=time.perf_counter() - t0)
  if rc != 0:
    rec["error"] = "\n".join(tail)[-4000:]
    if time.perf_counter() - t0 >= limit:
      rec["error"] = f"killed after {limit:.0f} s\n" + rec["error"]
    log(f"variant {name}: exit code {rc}")
  write(a, results)


def fmt(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
  """The rows as a table: one line per (variant, shape, batch), its top kernels beneath."""
  head = (f"{'variant':14s} {'shape':11s} {'batch':>5s} {'ms/step':>8s} {'traced':>8s} "
          f"{'roof':>7s} {'kind':6s} {'events':>7s} {'busy ms':>8s} {'gap ms':>7s} "
          f"{'gaps>thr':>8s} {'D2H':>5s} {'H2D':>5s}")
  lines = [head, ("(per decode step; events: device stream kernels and copies, or host XLA "
                 "ops; gaps>thr: idle gaps over the threshold; D2H/H2D: copies)"),
           "-" * len(head)]
  for r in rows:
    start = f"{r['variant'][:14]:14s} {r['shape'][:11]:11s} {r['batch']:5d}"
    if "error" in r:
      lines.append(f"{start} failed: {r['error'][:120]}")
      continue
    mid = (f"{r['step_ms']:8.3f} {fmt(r.get('traced_step_ms'), '8.3f'):>8s} "
           f"{r['roof_step_ms']:7.3f}")
    if "trace" not in r:
      lines.append(f"{start} {mid} trace failed: {r.get('trace_error', '')[:120]}")
      continue
    t = r["trace"]
    copies = t["memcpy"]
    d2h = copies.get("D2H", {}).get("per_step") if t["kind"] == "device" else None
    h2d = copies.get("H2D", {}).get("per_step") if t["kind"] == "device" else None
    lines.append(f"{start} {mid} {t['kind']:6s} {t['events_per_step']:7.1f} "
                 f"{t['busy_ms_per_step']:8.3f} {t['gap_ms_per_step']:7.3f} "
                 f"{t['long_gaps_per_step']:8.1f} {fmt(d2h, '5.1f'):>5s} {fmt(h2d, '5.1f'):>5s}")
    for k in t["top"]:
      share = fmt(None if k["share_of_busy"] is None else 100 * k["share_of_busy"], "4.1f")
      lines.append(f"    {k['ms_per_step']:8.4f} ms {k['per_step']:6.1f}x {share:>5s}%  "
                   f"{k['name'][:90]}")
  return "\n".join(lines)


def run_parent(a, argv: list[str]) -> dict:
  results = {"command": "python experiments/profile_gpu.py " + " ".join(argv), "args": {
      k: v for k, v in vars(a).items() if k not in ("variant", "trace_run_dir")},
             "partial": True, "variants": {}, "rows": [], "skipped": []}
  if a.keep_traces:
    trace_root = os.path.abspath(a.keep_traces)
    os.makedirs(trace_root, exist_ok=True)
  else:
    os.makedirs(a.trace_dir, exist_ok=True)
    trace_root = tempfile.mkdtemp(prefix="profile_gpu-", dir=a.trace_dir)
  results["traces"] = {"dir": trace_root, "kept": bool(a.keep_traces)}
  write(a, results)
  try:
    for name, flags in a.variants:
      if time.perf_counter() - bench_gpu.START > a.budget_s:
        log(f"skipped variant {name}: over --budget-s {a.budget_s:.0f}")
        results["skipped"].append({"variant": name, "what": "every row"})
        continue
      run_child(a, argv, name, flags, trace_root, results)
  finally:
    if not a.keep_traces:
      shutil.rmtree(trace_root, ignore_errors=True)
  results["partial"] = False
  write(a, results)
  print(table(results["rows"]), flush=True)
  log(f"done: {a.out}" + (f" (traces kept in {trace_root})" if a.keep_traces else ""))
  return results


def main(argv=None) -> dict | None:
  """The parent (no --variant) runs a process per variant and never touches a device itself
  (the GPU's memory is the measuring process's); a child (--variant) measures its rows."""
  argv = list(sys.argv[1:] if argv is None else argv)
  bench_gpu.START = time.perf_counter()  # the clock of log, write and the budget: this run's
  a = parse_args(argv)
  if a.variant:
    if not a.trace_run_dir:
      raise SystemExit("--variant needs --trace-run-dir (both are set by the parent process)")
    run_variant(a)
    return None
  return run_parent(a, argv)


if __name__ == "__main__":
  from specjax.jobs import run_main
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
