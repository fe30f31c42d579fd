"""The CPU matrix kernel at decode shapes: the weight products of the 0.47B Qwen3 layer (hidden
1024, 16 q / 8 kv heads of 128, MLP 3072; float32) for M = 1..64 rows, XLA against torch.

  python experiments/bench_matmul.py --quick     # M in 1, 8, 32; fewer repeats (~2 minutes)
  python experiments/bench_matmul.py             # M in 1, 2, 4, 8, 16, 32, 64

One timed call is a 28-layer chain, each layer with its own weights (1.76 GB in all, so they stream
from memory as in decode, never from cache): h -> q, k, v = h Wq, h Wk, h Wv -> h += (q/2) Wo ->
g, u = h Wg, h Wu -> h += (silu(g) u) Wd -> RMS-normalise h; k + v accumulate into a second output.
Three forms: `separate` (q [1024, 2048], k and v [1024, 1024] each, o [2048, 1024], gate and up
[1024, 3072], down [3072, 1024]), `fused` (q|k|v as one [1024, 4096], gate|up as one
[1024, 6144]) and `out_in` (the separate products, XLA's weights stored transposed). Weights are
laid out [in, out] as specjax keeps them (x @ W), except in `out_in`; torch gets them [out, in]
as its models keep them (F.linear), its `out_in` the same program as its `separate`. Reported per chain: ms (best of all timed chains:
--repeats per round, in --rounds rounds; medians in the JSON), GB/s of weight reads, GFLOP/s
(2 M x weights), and the time over torch's. A loaded machine moves these by 2x between minutes:
compare arms on a quiet one.

Arms: XLA (jax.jit; the CPU's cores) under its default flags and under each XLA CPU option in
--xla-option (one process per flag set, since XLA_FLAGS is read once at start; an option XLA
rejects is reported as rejected, and what XLA logs about an accepted one is kept), and torch
(torch.set_num_threads(--threads), CPU build: MKL / oneDNN) run in the vLLM venv (see
experiments/peer_vllm.py) as a subprocess when it exists: `torch` in vLLM's CPU environment
(tcmalloc and Intel OpenMP preloaded, OMP_NUM_THREADS), the reference of the ratios, and
`torch gomp` with torch's own GNU OpenMP, as a plain `pip install torch` runs. Each XLA arm's
optimized program is summarised (dots, fusion kinds such as __ynn_fusion) and fingerprinted: an
arm whose programs equal the default's is marked `=default` (its times then differ by noise
alone, unless the option acts below the HLO).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench_io import write_json
from specjax.jobs import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = 28
D, Q, KV, MLP = 1024, 2048, 1024, 3072  # hidden, q width (16 x 128), k or v width (8 x 128), MLP
FORMS = {  # name -> [(product, (in, out))]
    "separate": [("q", (D, Q)), ("k", (D, KV)), ("v", (D, KV)), ("o", (Q, D)), ("gate", (D, MLP)),
                 ("up", (D, MLP)), ("down", (MLP, D))],
    # the separate products with XLA's weights stored [out, in] (as torch keeps them), each
    # product contracting the weight's second axis
    "out_in": [("q", (D, Q)), ("k", (D, KV)), ("v", (D, KV)), ("o", (Q, D)), ("gate", (D, MLP)),
               ("up", (D, MLP)), ("down", (MLP, D))],
    "fused": [("qkv", (D, Q + 2 * KV)), ("o", (Q, D)), ("gateup", (D, 2 * MLP)), ("down", (MLP, D))],
}
# jax 0.10.2's default CPU dot is a YNNPACK fusion; an empty ynn fusion type turns it off (XLA's
# own dot emitter / Eigen)
XLA_OPTIONS = ["--xla_cpu_use_thunk_runtime=false", "--xla_cpu_experimental_onednn_fusion_type=dot",
               "--xla_cpu_experimental_xnn_fusion_type=dot", "--xla_cpu_use_xnnpack=true",
               "--xla_cpu_experimental_ynn_fusion_type="]


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="M in 1, 8, 32; fewer repeats")
  p.add_argument("--rows", default="", help="comma-separated M; default 1,2,4,8,16,32,64")
  p.add_argument("--forms", default="separate,fused")
  p.add_argument("--repeats", type=int, default=0, help="timed chains per (M, form) and round; default 5 (--quick 3)")
  p.add_argument("--rounds", type=int, default=0,
                 help="each arm's process runs once per round, arms in turn; default 2 (--quick 1)")
  p.add_argument("--xla-option", action="append", default=None, metavar="FLAGS",
                 help="an XLA flag set to try besides the default (several flags: space-separated "
                      "in one argument); repeatable; default: " + " | ".join(XLA_OPTIONS))
  p.add_argument("--no-xla-options", action="store_true", help="XLA under its default flags only")
  p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
  p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", os.path.join(
      os.path.dirname(REPO), "vllm-venv")), help="the venv with torch (env VLLM_VENV; default ../vllm-venv)")
  p.add_argument("--no-torch", action="store_true")
  p.add_argument("--torch-gomp", action=argparse.BooleanOptionalAction, default=None,
                 help="also torch with its own GNU OpenMP (default: on; --quick: off)")
  p.add_argument("--timeout", type=int, default=900, help="seconds per arm's process")
  p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_matmul.json"))
  p.add_argument("--child", choices=["xla", "torch"], help=argparse.SUPPRESS)
  p.add_argument("--result", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  a.rows = [int(x) for x in (a.rows or ("1,8,32" if a.quick else "1,2,4,8,16,32,64")).split(",")]
  a.forms = [f for f in a.forms.split(",") if f]
  for f in a.forms:
    if f not in FORMS:
      p.error(f"unknown form {f!r}; forms: {sorted(FORMS)}")
  a.repeats = a.repeats or (3 if a.quick else 5)
  a.rounds = a.rounds or (1 if a.quick else 2)
  if a.torch_gomp is None:
    a.torch_gomp = not a.quick
  a.xla_options = [] if a.no_xla_options else (a.xla_option or XLA_OPTIONS)
  return a


def host_weights(form: str, seed: int = 0):
  """One layer's weights [in, out] (uniform, scaled 1/sqrt(in)) per product, float32 numpy."""
  import numpy as np
  rng = np.random.default_rng(seed)
  return {name: ((rng.random((i, o), dtype=np.float32) - 0.5) * (3.46 / i ** 0.5))
          for name, (i, o) in FORMS[form]}


def time_chain(call, repeats: int) -> dict:
  call()  # compile, first touch
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    call()
    times.append(time.perf_counter() - t)
  return {"best_s": min(times), "median_s": statistics.median(times), "times_s": times}


# ---------------------------------------------------------------- XLA arm (one process per flag set)

def child_xla(a) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  def layer(form, h, acc, w):
    mm = ((lambda x, wt: jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ()))))
          if form == "out_in" else (lambda x, wt: x @ wt))
    if form == "fused":
      qkv = h @ w["qkv"]
      q, k, v = qkv[:, :Q], qkv[:, Q:Q + KV], qkv[:, Q + KV:]
    else:
      q, k, v = mm(h, w["q"]), mm(h, w["k"]), mm(h, w["v"])
    h = h + mm(0.5 * q, w["o"])
    if form == "fused":
      gu = h @ w["gateup"]
      g, u = gu[:, :MLP], gu[:, MLP:]
    else:
      g, u = mm(h, w["gate"]), mm(h, w["up"])
    h = h + mm(jax.nn.silu(g) * u, w["down"])
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    return h, acc + k + v

  out = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "runs": [], "hlo": {}}
  for form in a.forms:
    base = host_weights(form)
    if form == "out_in":
      base = {k: np.ascontiguousarray(v.T) for k, v in base.items()}
    # distinct buffers per layer (values scaled per layer; no two layers share memory)
    weights = [{k: jax.device_put(v * np.float32(1 + 1e-3 * i)) for k, v in base.items()}
               for i in range(LAYERS)]
    del base
    fn = jax.jit(lambda h, acc, ws, form=form: _chain(layer, form, h, acc, ws))
    for m in a.rows:
      h = jnp.asarray(np.random.default_rng(m).standard_normal((m, D), dtype=np.float32))
      acc = jnp.zeros((m, KV), jnp.float32)
      t = time.perf_counter()
      compiled = fn.lower(h, acc, weights).compile()
      compile_s = time.perf_counter() - t
      text = compiled.as_text()  # the optimized program: XLA picks its kernels per shape
      kinds = collections.Counter(re.findall(r'"kind":"(__\w+)"', text))
      out["hlo"][f"{form}|{m}"] = {
          "dots": text.count(" dot("), "custom_calls": text.count("custom-call"),
          "fusion_kinds": dict(kinds), "fingerprint": hashlib.sha1(text.encode()).hexdigest()[:12]}
      call = lambda: jax.block_until_ready(compiled(h, acc, weights))
      r = time_chain(call, a.repeats)
      out["runs"].append(dict(r, form=form, m=m, compile_s=compile_s))
      print(f"  {form} M={m}: {1e3 * r['best_s']:.1f} ms", flush=True)
    weights = fn = compiled = call = None  # free this form's weights before the next
  return out


def _chain(layer, form, h, acc, ws):
  for w in ws:  # unrolled: 28 layers, each its own weights
    h, acc = layer(form, h, acc, w)
  return h, acc


# ---------------------------------------------------------------- torch arm (in the vLLM venv)

def child_torch(a) -> dict:
  import torch
  import torch.nn.functional as F

  torch.set_num_threads(a.threads)
  out = {"torch": torch.__version__, "threads": torch.get_num_threads(),
         "mkldnn": torch.backends.mkldnn.is_available(), "mkl": torch.backends.mkl.is_available(),
         "config": torch.__config__.show(), "runs": []}
  for form in a.forms:
    base = {k: torch.from_numpy(v).t().contiguous() for k, v in host_weights(form).items()}  # [out, in]
    weights = [{k: v * (1 + 1e-3 * i) for k, v in base.items()} for i in range(LAYERS)]
    del base

    @torch.inference_mode()
    def chain(h, acc):
      for w in weights:
        if form == "fused":
          q, k, v = F.linear(h, w["qkv"]).split([Q, KV, KV], dim=-1)
        else:
          q, k, v = F.linear(h, w["q"]), F.linear(h, w["k"]), F.linear(h, w["v"])
        h = h + F.linear(0.5 * q, w["o"])
        if form == "fused":
          g, u = F.linear(h, w["gateup"]).split([MLP, MLP], dim=-1)
        else:
          g, u = F.linear(h, w["gate"]), F.linear(h, w["up"])
        h = h + F.linear(F.silu(g) * u, w["down"])
        h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6)
        acc = acc + k + v
      return h, acc

    for m in a.rows:
      g = torch.Generator().manual_seed(m)
      h = torch.randn((m, D), generator=g, dtype=torch.float32)
      acc = torch.zeros((m, KV), dtype=torch.float32)
      r = time_chain(lambda: chain(h, acc), a.repeats)
      out["runs"].append(dict(r, form=form, m=m))
      print(f"  {form} M={m}: {1e3 * r['best_s']:.1f} ms", flush=True)
    weights = None  # free this form's weights before the next
  return out


# ---------------------------------------------------------------- driver

def child_args(a) -> list[str]:
  return ["--rows", ",".join(map(str, a.rows)), "--forms", ",".join(a.forms), "--repeats",
          str(a.repeats), "--threads", str(a.threads)]


def run_child(a, kind: str, python: str, env: dict) -> dict:
  """{"status": "ok", ...} | {"status": "rejected" | "failed", "error": ...}"""
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    res = os.path.join(tmp, "result.json")
    cmd = [python, os.path.abspath(__file__), "--child", kind, "--result", res] + child_args(a)
    try:
      p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=a.timeout, cwd=tmp)
      text, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
      out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
      return {"status": "failed", "error": f"timed out after {a.timeout} s", "output": out[-2000:]}
    for line in text.splitlines():
      if line.startswith("  "):
        print(line, flush=True)
    # what XLA says about the flags it accepted (e.g. "... is no longer supported")
    warnings = [l.strip() for l in text.splitlines() if "debug_options_flags" in l]
    if rc == 0 and os.path.exists(res):
      with open(res) as f:
        return dict(json.load(f), status="ok", warnings=warnings,
                    wall_s=time.perf_counter() - t0)
  said = [l.strip() for l in text.splitlines()
          if any(k in l for k in ("Unknown flag", "Illegal value", "Flag parsing failed"))]
  if said:
    return {"status": "rejected", "error": " | ".join(said[:2])}
  return {"status": "failed", "error": f"exit {rc}", "output": text[-2000:]}


def machine() -> dict:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def print_table(s: dict) -> None:
  print(f"\n28-layer chains of the 0.47B layer's weight products, float32, "
        f"{s['weights_bytes'] / 1e9:.2f} GB of weights; best of {s['args']['repeats']} x "
        f"{s['args']['rounds']} rounds; "
        f"'/ torch' = ms / torch's ms (< 1: faster than torch)")
  default = s["arms"].get("xla default", {}).get("hlo", {})
  for name, arm in s["arms"].items():
    if arm["status"] != "ok":
      print(f"  {name}: {arm['status']}: {arm['error'][:300]}")
      continue
    for w in arm.get("warnings", []):
      print(f"  {name}: XLA says: {w.split('] ', 1)[-1][:200]}")
  print("XLA's optimized programs, per form|M: dots, fusion kinds ('=default': the same program "
        "as the default flags')")
  for name, arm in s["arms"].items():
    if arm.get("hlo"):
      print(f"  {name}: " + "; ".join(
          f"{key} {h['dots']} dots"
          + "".join(f" {n} {k}" for k, n in h["fusion_kinds"].items())
          + (" =default" if name != "xla default" and
             default.get(key, {}).get("fingerprint") == h["fingerprint"] else "")
          for key, h in arm["hlo"].items()))
  print(f"{'M':>3} {'form':<9} {'arm':<56} {'ms':>8} {'GB/s':>7} {'GFLOP/s':>8} {'/ torch':>8}")
  for m in s["args"]["rows"]:
    for form in s["args"]["forms"]:
      ref = s["table"].get(f"torch|{form}|{m}")
      for name in s["arms"]:
        r = s["table"].get(f"{name}|{form}|{m}")
        if r is None:
          continue
        ratio = f"{r['ms'] / ref['ms']:>8.2f}" if ref else f"{'-':>8}"
        fp = s["arms"][name].get("hlo", {}).get(f"{form}|{m}", {}).get("fingerprint")
        label = name + (" =default" if name != "xla default" and fp and
                        fp == default.get(f"{form}|{m}", {}).get("fingerprint") else "")
        print(f"{m:>3} {form:<9} {label:<56} {r['ms']:>8.1f} {r['gb_s']:>7.1f} "
              f"{r['gflop_s']:>8.1f} {ratio}")


def main(argv=None) -> dict:
  a = parse_args(argv)
  if a.child:
    res = (child_xla if a.child == "xla" else child_torch)(a)
    write_json(a.result, res)
    return res
  t0 = time.perf_counter()
  base_env = dict(os.environ)
  base_env.pop("XLA_FLAGS", None)
  plan = []  # (arm name, python, env, what to record)
  for flags in [""] + a.xla_options:
    env = dict(base_env, XLA_FLAGS=flags) if flags else base_env
    plan.append(("xla " + (flags or "default"), "xla", sys.executable, env, {"xla_flags": flags}))
  torch_py = os.path.join(os.path.abspath(a.vllm_venv), "bin", "python")
  skipped = {}
  if a.no_torch:
    pass
  elif os.path.exists(torch_py):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from peer_vllm import preload_libs
    libs, info = preload_libs(a.vllm_venv)
    plain = {k: v for k, v in base_env.items() if k != "LD_PRELOAD"}
    plain.update(OMP_NUM_THREADS=str(a.threads), PYTHONNOUSERSITE="1")
    env = dict(plain, LD_PRELOAD=":".join(libs)) if libs else plain
    plan.append(("torch", "torch", torch_py, env, {"preload": info, "LD_PRELOAD": ":".join(libs)}))
    if a.torch_gomp:
      plan.append(("torch gomp", "torch", torch_py, plain, {"preload": None, "LD_PRELOAD": ""}))
  else:
    print(f"torch: skipped, no venv at {a.vllm_venv} (see experiments/peer_vllm.py)")
    skipped["torch"] = {"status": "skipped", "error": f"no venv at {a.vllm_venv}"}

  # rounds: every arm once per round, in reverse order on odd rounds, so that a drift in the
  # machine's speed spreads over all arms; each arm's runs of all rounds are pooled
  arms: dict[str, dict] = {}
  for rnd in range(a.rounds):
    for name, kind, py, env, extra in (plan if rnd % 2 == 0 else plan[::-1]):
      if arms.get(name, {}).get("status", "ok") != "ok":
        continue  # rejected or failed: not retried
      print(f"{name} (round {rnd + 1}/{a.rounds}) ...", flush=True)
      res = dict(run_child(a, kind, py, env), **extra)
      prev = arms.get(name)
      if prev is None or res["status"] != "ok":
        arms[name] = res
        continue
      for r_prev, r in zip(prev["runs"], res["runs"]):
        r_prev["times_s"] += r["times_s"]
        r_prev["best_s"] = min(r_prev["times_s"])
        r_prev["median_s"] = statistics.median(r_prev["times_s"])
      prev["wall_s"] += res["wall_s"]
  arms.update(skipped)

  per_layer = {form: sum(i * o for _, (i, o) in FORMS[form]) for form in FORMS}
  table = {}
  for name, arm in arms.items():
    for r in arm.get("runs", []):
      n = LAYERS * per_layer[r["form"]]
      t = r["best_s"]
      table[f"{name}|{r['form']}|{r['m']}"] = {
          "ms": 1e3 * t, "median_ms": 1e3 * r["median_s"], "gb_s": 4 * n / t / 1e9,
          "gflop_s": 2 * r["m"] * n / t / 1e9}
  import jax
  s = {"args": {k: v for k, v in vars(a).items() if k not in ("child", "result")},
       "machine": machine(), "versions": {"jax": jax.__version__,
                                          "torch": arms.get("torch", {}).get("torch")},
       "weights_bytes": 4 * LAYERS * per_layer["separate"], "arms": arms, "table": table,
       "wall_s": time.perf_counter() - t0}
  print_table(s)
  write_json(a.out, s)
  print(f"\nwrote {a.out} ({s['wall_s']:.0f} s)")
  return s


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
