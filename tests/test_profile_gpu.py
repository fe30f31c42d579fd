"""experiments/profile_gpu.py: it runs on the day a GPU is lent, for minutes, so its every path
must already work here: the smoke run end to end on the CPU (host events), the device-stream
summary on a GPU-shaped trace, and every named variant's XLA flags parsed by this jaxlib (XLA
aborts on an unknown flag)."""

import gzip
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))

import profile_gpu  # noqa: E402


def test_smoke_run_writes_a_row_per_batch_and_removes_its_traces(tmp_path):
  out, traces = tmp_path / "profile.json", tmp_path / "traces"
  profile_gpu.main(["--smoke", "--repeats", "1", "--out", str(out), "--trace-dir", str(traces)])
  data = json.loads(out.read_text())
  assert data["partial"] is False and data["skipped"] == []
  variant = data["variants"]["default"]
  assert variant["rc"] == 0 and variant["rows"] == 2
  assert profile_gpu.TRACE_CMDBUF_FLAG in variant["xla_flags"]
  assert [r["batch"] for r in data["rows"]] == [1, 2]
  for row in data["rows"]:
    assert row["variant"] == "default" and row["shape"] == "smoke"
    assert row["step_ms"] > 0 and row["traced_step_ms"] > 0 and row["steps"] == 7
    t = row["trace"]
    assert t["kind"] == "host" and t["window"] == "segment" and t["steps"] == 7
    assert t["events_per_step"] > 0 and t["busy_ms_per_step"] > 0 and t["top"]
    assert t["round_trips_per_step"] is None  # no device, no copies to the host
    assert t["nested_per_step"] > 0  # the segment's while loop holds the step's ops
  assert not os.path.exists(data["traces"]["dir"]) and os.listdir(traces) == []


def gpu_trace(path):
  """A GPU-shaped perfetto trace: a prefill kernel, then 2 decode steps of the segment, each a
  gemm (10 us), a fusion (5 us) and a 4-byte copy to the host, 21 us idle before the next step;
  the host's driver calls beside them."""
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CUPTI"}},
          {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
           "args": {"name": "Stream #7(Kernel,MemcpyD2H)"}},
          {"ph": "M", "pid": 3, "tid": 9, "name": "thread_name",
           "args": {"name": "Host Threads/9"}}]
  seg = {"hlo_module": "jit_run_segment"}
  ev = lambda pid, tid, name, ts, dur, **args: {"ph": "X", "pid": pid, "tid": tid, "name": name,
                                                "ts": ts, "dur": dur, "args": args}
  events = [ev(2, 7, "prefill_fusion", 10, 40, hlo_module="jit_init_state")]
  for t in (100, 140):
    events += [ev(2, 7, "sm90_xmma_gemm_bf16bf16", t, 10, **seg),
               ev(2, 7, "loop_add_fusion", t + 12, 5, **seg),
               ev(2, 7, "MemcpyD2H", t + 18, 1, memcpy_details="kind_src:device "
                  "kind_dst:pinned size:4 dest:0 async:1", **seg),
               ev(3, 9, "cuLaunchKernel", t + 1, 3), ev(3, 9, "cuLaunchKernel", t + 4, 3),
               ev(3, 9, "cuMemcpyDtoHAsync_v2", t + 8, 1),
               ev(3, 9, "cuStreamSynchronize", t + 9, 12)]
  with gzip.open(path, "wt") as f:
    json.dump({"displayTimeUnit": "ns", "traceEvents": meta + events}, f)


def test_device_summary_counts_kernels_gaps_and_round_trips_per_step(tmp_path):
  path = tmp_path / "perfetto_trace.json.gz"
  gpu_trace(path)
  t = profile_gpu.summarize(profile_gpu.load_perfetto(str(path)), steps=2, gap_us=5.0, top=5)
  approx = lambda x, y: abs(x - y) < 1e-9
  assert t["kind"] == "device" and t["window"] == "segment"  # the prefill kernel left out
  assert t["events_per_step"] == 3 and t["kernels_per_step"] == 2
  assert t["round_trips_per_step"] == 1 and t["memcpy"]["D2H"]["bytes_per_step"] == 4
  assert approx(t["busy_ms_per_step"], 0.016) and approx(t["span_ms_per_step"], 0.0295)
  assert approx(t["gap_ms_per_step"], 0.0135)  # gaps 2, 1, 21, 2, 1 us
  assert t["long_gaps_per_step"] == 0.5 and approx(t["long_gap_ms_per_step"], 0.0105)
  assert [k["name"] for k in t["top"]] == ["sm90_xmma_gemm_bf16bf16", "loop_add_fusion"]
  assert set(t["classes"]) == {"gemm", "fusion"}
  counters = t["host"]["counters_per_step"]
  assert counters["kernel_launches"] == 2 and counters["memcpy_d2h_calls"] == 1
  assert counters["syncs"] == 1 and counters["graph_launches"] == 0
  row = {"variant": "default", "shape": "qwen3-1.7b", "batch": 1, "step_ms": 2.41,
         "traced_step_ms": 3.0, "roof_step_ms": 1.03, "trace": t}
  text = profile_gpu.table([row])
  assert "device" in text and "sm90_xmma_gemm_bf16bf16" in text


def test_variant_flags_parse_in_this_jaxlib():
  """XLA reads XLA_FLAGS at backend start and aborts on an unknown flag or value: every named
  variant's flags, and the one that keeps command buffers under the profiler, must start it."""
  assert profile_gpu.variant_flags("mine=--xla_a=1 --xla_b=2") == ("mine", "--xla_a=1 --xla_b=2")
  # one process: each flag's value is parsed in turn (a later one of the same flag wins)
  flags = " ".join([*profile_gpu.VARIANTS.values(), profile_gpu.TRACE_CMDBUF_FLAG])
  done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags), text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  bad = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILST")
  done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                        env=bad, text=True, timeout=120)
  assert done.returncode != 0  # a misspelt value stops XLA: the check above means something
