"""Peer on the GPU: Hugging Face transformers compiled with torch (static KV cache, CUDA graphs)
beside specjax's AR decode step, on the same random-weight Qwen3 checkpoints, prompts and batches
(greedy, no EOS: every row runs every step). JSON out, rewritten after every measurement with
`partial: true` until the end, so a run stopped at its time limit keeps what it measured.

  python experiments/peer_torch_gpu.py --out runs/peer_torch_gpu.json   # 1.7B and 8B, 1/64/256
  python experiments/peer_torch_gpu.py --shapes qwen3-1.7b --batches 1 64
  python experiments/peer_torch_gpu.py --smoke --device cpu --out /tmp/peer.json  # any machine
  python experiments/peer_torch_gpu.py --smoke --device cuda   # the CUDA-graph path, tiny shape

Needs bench_gpu.py's set plus torch and transformers (neither is a specjax dependency: the peer
side imports them inside its functions, so --help works without them). Nothing is downloaded.
Run it from the repository root.

Checkpoints: one per shape of bench_gpu's SHAPES table, random weights (bench_gpu's
`build_target` with every layer live, --seed) written with specjax's own `export_hf` in --dtype as
a transformers directory (config.json + safetensors shards). Both sides read that directory:
specjax through `specjax.models.hf.load_pretrained`, transformers through
`AutoModelForCausalLM.from_pretrained(dir, dtype=...)`, so they run the same weights. The 8B
checkpoint is 16 GB in bfloat16: it goes to a temporary directory, removed when its shape is done
and at exit, or under --work-dir (never inside the repository), where it stays and later runs
reuse it (a marker file inside says which shape, dtype and seed made it).

Processes: this process only orchestrates and never touches a device. For each shape it runs this
file three times in turn as a child (`--side`): `write` (the checkpoint; jax on the device),
`specjax` (load, then decode) and `torch` (load, then decode; jax on the CPU there, for the
prompts only). Each child has the GPU to itself, so neither framework's allocator (XLA takes 75%
of the device up front by default) starves the other, and each side's peak memory is its own.
Children print their results as tagged JSON lines, folded into the JSON as they arrive.

What each figure is, per shape and batch (prompts: --prompt-len random token ids from bench_gpu's
`prompts_for` with the same seed on both sides; --new-tokens greedy tokens):
- specjax: bench_gpu's `decode_row` at temperature 0: `generate` with the plain loop (STATIC);
  the first call (compile + run), then the fastest of --repeats calls; ms per step = that call's
  decode segment seconds / its steps (no prefill), tokens/s = batch / step; bench_gpu's roof
  fields beside them. Peak memory: the device's peak bytes in use so far in the child (a running
  peak over the batches, in the order given), as bench_gpu reports it.
- torch: a `StaticCache` of prompt + new tokens; the prefill eager (`logits_to_keep=1`), then
  new_tokens - 1 single-token forwards through `torch.compile(model.forward,
  mode="reduce-overhead", fullgraph=True, dynamic=False)` (CUDA graphs), each followed by an
  argmax. `first_call_s`: the first generation, compile included; `compile_s`: its first compiled
  forward. Then --repeats generations on the same cache (reset in place), the decode loop of each
  timed alone between torch.cuda.synchronize calls; the fastest gives ms per step and tokens/s.
  Peak memory: torch.cuda.max_memory_allocated, reset before each batch. Compiled programs are
  dropped before each batch (torch._dynamo.reset), so each batch's compile is its own;
  `compiled_graphs` (programs dynamo made for the batch; 1: no recompiles) and `cudagraph_skips`
  (runs inductor made without CUDA graphs; 0 where reduce-overhead replays them) say whether the
  compiled path is the one intended.
  --torch-compile picks the mode; `auto` is reduce-overhead on cuda and eager on cpu (inductor
  takes about a minute per batch on two cores there, and the CPU has no CUDA graphs). A compile
  that fails falls back to eager, with its error and the mode used in the JSON.
- comparison: specjax / torch ms per step (below 1: specjax's step is faster), and the first
  --compare-tokens greedy tokens of every row from both sides: tokens equal, the first position
  that differs in each row, and the largest difference of the chosen tokens' log-probabilities
  over each row's equal prefix. In bfloat16 near-ties can flip, so this is reported, never
  asserted; in float32 (--smoke) both sides agree. With random weights the residual stream is
  mostly the current token's embedding and greedy chains soon repeat a token: the check says both
  sides compute the same function on the same weights, nothing about text.

--budget-s: a shape, side or batch that would start after that many seconds is skipped (listed in
`skipped`). --smoke: bench_gpu's tiny `smoke` shape in float32, batches 1 and 2, 8 prompt and 8
new tokens, on the CPU unless --device says otherwise; other flags still apply.
"""

from __future__ import annotations

import argparse
import collections
import gc
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (REPO, HERE):
  if _path not in sys.path:
    sys.path.insert(0, _path)

import bench_gpu  # noqa: E402  (imports jax; no device is touched until a child uses one)
from bench_gpu import SHAPES, log, over_budget, write  # noqa: E402
from specjax.errors import UserError  # noqa: E402
from specjax.jobs import run_main  # noqa: E402

TAG = "@peer_torch_gpu "  # a child's result line: TAG + JSON
MARKER = "peer_torch_gpu_checkpoint.json"  # written into a checkpoint this script made
SIDES = ("specjax", "torch")
COMPILE_MODES = ("auto", "reduce-overhead", "default", "eager")
KEPT_ROWS = 4  # greedy tokens kept in the JSON for the first rows of each batch


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--shapes", nargs="+", default=["qwen3-1.7b", "qwen3-8b"], choices=list(SHAPES),
                 help="bench_gpu.py's SHAPES, in this order")
  p.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="of the checkpoint and of both sides' compute")
  p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  p.add_argument("--torch-compile", default="auto", choices=COMPILE_MODES,
                 help="torch.compile mode of the decode forward (auto: reduce-overhead on cuda, "
                      "eager on cpu)")
  p.add_argument("--compare-tokens", type=int, default=8,
                 help="first greedy tokens of each row compared across the sides")
  p.add_argument("--repeats", type=int, default=3,
                 help="timed calls after the first of each side and batch (the fastest is "
                      "reported)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--budget-s", type=float, default=480.0,
                 help="shapes, sides and batches that would start after this many seconds are "
                      "skipped (logged)")
  p.add_argument("--work-dir", default=None,
                 help="where the checkpoints go and stay (reused by later runs); default: a "
                      "temporary directory removed at the end")
  p.add_argument("--out", default="runs/peer_torch_gpu.json")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shape in float32 on the CPU (a check that the script runs, not a "
                      "benchmark)")
  # a child's part (this file run by the orchestrating process)
  p.add_argument("--side", choices=("write",) + SIDES, default=None, help=argparse.SUPPRESS)
  p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
  p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
  if "--smoke" in (sys.argv[1:] if argv is None else argv):  # other defaults; flags still apply
    p.set_defaults(shapes=["smoke"], batches=[1, 2], prompt_len=8, new_tokens=8,
                   dtype="float32", device="cpu", repeats=2)
  a = p.parse_args(argv)
  for name in ("prompt_len", "repeats", "compare_tokens"):
    if getattr(a, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
  if a.new_tokens < 2:
    p.error(f"--new-tokens must be >= 2 (one from the prefill, then decode steps), got "
            f"{a.new_tokens}")
  if any(b < 1 for b in a.batches):
    p.error(f"--batches must be >= 1, got {a.batches}")
  a.compare_tokens = min(a.compare_tokens, a.new_tokens)
  if a.work_dir is not None:
    work, repo = os.path.realpath(a.work_dir), os.path.realpath(REPO)
    if work == repo or work.startswith(repo + os.sep):
      p.error(f"--work-dir {a.work_dir} is inside the repository; checkpoints go elsewhere")
  if a.torch_compile == "auto":
    a.torch_compile = "reduce-overhead" if a.device == "cuda" else "eager"
  return a


def emit(event: str, **fields) -> None:
  """A child's result, as one tagged JSON line on stdout for the orchestrating process."""
  print(TAG + json.dumps(dict(fields, event=event)), flush=True)


def budget_left(a, what: str) -> bool:
  """False (and the skip reported) when `what` would start after --budget-s."""
  if over_budget(a, what, {}):
    emit("skipped", what=what)
    return False
  return True


# -- children -------------------------------------------------------------------------------------

def side_write(a) -> None:
  """The shape's random-weight checkpoint, written beside `a.ckpt` and renamed into place with
  its marker, so that a directory at `a.ckpt` is always whole."""
  from specjax.models.export import export_hf

  t0 = time.perf_counter()
  model = bench_gpu.build_target(a.shape, a.dtype, SHAPES[a.shape]["num_layers"], a.seed)
  built = time.perf_counter() - t0
  tmp = f"{a.ckpt}.making-{os.getpid()}"
  try:
    export_hf(model, tmp, dtype=a.dtype)
    nbytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
    marker = {"shape": a.shape, "dims": SHAPES[a.shape], "dtype": a.dtype, "seed": a.seed,
              "params": model.cfg.num_params(), "gbytes": nbytes / 1e9}
    with open(os.path.join(tmp, MARKER), "w") as f:
      json.dump(marker, f, indent=1)
    os.rename(tmp, a.ckpt)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  emit("checkpoint", **marker, build_s=built, write_s=time.perf_counter() - t0 - built)


def side_specjax(a) -> None:
  """specjax's AR decode step (bench_gpu's `decode_row`, greedy) on the loaded checkpoint, and the
  first greedy tokens of every row."""
  import jax
  import numpy as np
  from flax import nnx

  from specjax.models.hf import load_pretrained
  from specjax.sampling import STATIC, SamplingConfig, generate

  if a.dtype == "float32":  # no TF32 on GPUs: float32 is the mode whose tokens must agree
    jax.config.update("jax_default_matmul_precision", "highest")
  info = bench_gpu.device_info()
  emit("env", side="specjax", device=info)
  if a.device == "cuda" and info["platform"] != "gpu":
    raise RuntimeError(f"--device cuda, but jax runs on {info['platform']} (a jax without GPU "
                       "support?)")
  t0 = time.perf_counter()
  model = load_pretrained(a.ckpt, dtype=a.dtype)
  jax.block_until_ready(nnx.state(model))
  load_s = time.perf_counter() - t0
  bandwidth = bench_gpu.copy_bandwidth_gbps(64 if a.device == "cpu" else 1024)
  emit("load", side="specjax", load_s=load_s, params=model.cfg.num_params(), copy_gbps=bandwidth)
  graphdef, params = nnx.split(model)
  scfg = SamplingConfig(max_new_tokens=a.new_tokens, temperature=0.0)
  for b in a.batches:
    if not budget_left(a, f"specjax {a.shape} batch {b}"):
      continue
    row = bench_gpu.decode_row(a, model, graphdef, params, b, bandwidth, temperature=0.0)
    if "error" not in row:  # the same program again (compiled): its tokens
      prompts, lengths = bench_gpu.prompts_for(b, a.prompt_len, model.cfg.vocab_size, a.seed + b)
      out = generate((graphdef, params), prompts, lengths, jax.random.key(0), scfg, engine=STATIC)
      row["greedy_tokens"] = np.asarray(out.tokens)[:, :a.compare_tokens].tolist()
      row["greedy_logprobs"] = np.asarray(out.logprobs)[:, :a.compare_tokens].tolist()
    emit("row", side="specjax", row=row)
    gc.collect()


def load_transformers(path: str, dtype, device: str):
  """transformers' model of the checkpoint directory, on `device`, in `dtype`."""
  import transformers
  from transformers import AutoModelForCausalLM

  version = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
  kw = {"dtype" if version >= (4, 56) else "torch_dtype": dtype}  # `dtype` is the newer name
  try:
    model = AutoModelForCausalLM.from_pretrained(path, device_map=device, **kw)
  except (ImportError, ValueError):  # device_map needs accelerate in some versions
    model = AutoModelForCausalLM.from_pretrained(path, **kw).to(device)
  return model.eval()


def static_cache(model, batch: int, length: int, device, dtype):
  """A StaticCache of `length` positions: newer transformers take the config and length and size
  the rest on first use; older ones also take the batch, device and dtype."""
  from transformers import StaticCache

  named = inspect.signature(StaticCache.__init__).parameters
  kw = {"config": model.config, "max_cache_len": length}
  batch_name = next((n for n in ("max_batch_size", "batch_size") if n in named), None)
  if batch_name:
    kw[batch_name] = batch
  for name, value in (("device", device), ("dtype", dtype)):
    if name in named:
      kw[name] = value
  return StaticCache(**kw)


def torch_batch(a, model, ids, mode: str) -> dict:
  """One batch of greedy decode on transformers: the first generation (compile), then --repeats
  generations whose decode loops are timed alone."""
  import torch

  dev = ids.device
  b, prompt = ids.shape
  steps = a.new_tokens - 1
  named = inspect.signature(model.forward).parameters
  cache_kw = "cache" if "cache" in named else "past_key_values"  # transformers 5 renamed it
  keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in named), None)
  # older versions place each step by its cache_position; newer ones keep the count in the cache
  positions = ([torch.arange(prompt, device=dev)] +
               [torch.tensor([prompt + i], device=dev) for i in range(steps)]
               if "cache_position" in named else None)
  torch._dynamo.reset()
  cache = static_cache(model, b, prompt + a.new_tokens, dev, model.dtype)
  step = model.forward if mode == "eager" else torch.compile(
      model.forward, mode=None if mode == "default" else mode, fullgraph=True, dynamic=False)
  mark = mode == "reduce-overhead" and hasattr(torch.compiler, "cudagraph_mark_step_begin")
  sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

  def logprob(logits, tok):
    return torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None])[:, 0]

  def generation(first: bool):
    """(tokens [b, new_tokens], logprobs of the first --compare-tokens, prefill seconds, first
    decode forward seconds (first generation only), decode loop seconds)."""
    cache.reset()
    kw = {cache_kw: cache, "use_cache": True}
    pre = dict(kw, **({keep_kw: 1} if keep_kw else {}),
               **({"cache_position": positions[0]} if positions else {}))
    sync()
    t0 = time.perf_counter()
    logits = model(input_ids=ids, **pre)[0][:, -1]
    tok = logits.argmax(-1)
    tokens, lps = [tok], ([logprob(logits, tok)] if first else [])
    sync()
    t1 = time.perf_counter()
    first_s = None
    for i in range(steps):
      if mark:
        torch.compiler.cudagraph_mark_step_begin()
      extra = {"cache_position": positions[i + 1]} if positions else {}
      logits = step(input_ids=tok[:, None], **kw, **extra)[0][:, -1]
      tok = logits.argmax(-1)
      tokens.append(tok)
      if first and len(lps) < a.compare_tokens:
        lps.append(logprob(logits, tok))
      if first and i == 0:
        sync()
        first_s = time.perf_counter() - t1
    sync()
    t2 = time.perf_counter()
    return torch.stack(tokens, 1), lps, t1 - t0, first_s, t2 - t1

  if dev.type == "cuda":
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
  counters = torch._dynamo.utils.counters
  graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
  t0 = time.perf_counter()
  tokens, lps, _, compile_s, _ = generation(first=True)
  first_call = time.perf_counter() - t0
  loops, prefills, same = [], [], True
  for _ in range(a.repeats):
    again, _, prefill, _, loop = generation(first=False)
    loops.append(loop)
    prefills.append(prefill)
    same = same and bool(torch.equal(again, tokens))
  best = min(loops)
  step_s = best / steps
  return {"batch": b, "prompt_len": prompt, "steps": steps, "compile_mode": mode,
          "first_call_s": first_call, "compile_s": compile_s,
          # programs dynamo made for this batch (1: no recompiles), and the times inductor ran
          # a compiled program without CUDA graphs (reduce-overhead: 0 when graphs replay)
          "compiled_graphs": counters["stats"]["unique_graphs"] - graphs,
          "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
          "step_ms": 1e3 * step_s, "tokens_per_s": b / step_s, "loops_s": loops,
          "prefill_s": prefills[loops.index(best)], "repeat_tokens_equal": same,
          "peak_memory_gb": (torch.cuda.max_memory_allocated(dev) / 1e9
                             if dev.type == "cuda" else None),
          "greedy_tokens": tokens[:, :a.compare_tokens].tolist(),
          "greedy_logprobs": torch.stack(lps, 1).tolist()}


def side_torch(a) -> None:
  """transformers' greedy decode on the loaded checkpoint at every batch."""
  import numpy as np
  import torch
  import transformers

  torch.set_grad_enabled(False)
  transformers.utils.logging.disable_progress_bar()  # one bar line per load, in the log
  dev = torch.device(a.device)
  dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
  emit("env", side="torch", device={
      "torch": torch.__version__, "transformers": transformers.__version__,
      "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
      "cuda": torch.version.cuda, "threads": torch.get_num_threads()})
  t0 = time.perf_counter()
  model = load_transformers(a.ckpt, dtype, a.device)
  if dev.type == "cuda":
    torch.cuda.synchronize()
  emit("load", side="torch", load_s=time.perf_counter() - t0,
       params=sum(p.numel() for p in model.parameters()), loaded_dtype=str(model.dtype),
       attention=getattr(model.config, "_attn_implementation", None), compile_mode=a.torch_compile)
  mode = a.torch_compile
  for b in a.batches:
    if not budget_left(a, f"torch {a.shape} batch {b}"):
      continue
    prompts, _ = bench_gpu.prompts_for(b, a.prompt_len, model.config.vocab_size, a.seed + b)
    ids = torch.tensor(np.asarray(prompts), dtype=torch.long, device=dev)
    try:
      row = torch_batch(a, model, ids, mode)
    except Exception as e:  # a compile that fails: the batch again, eager (kept for the rest)
      error = f"{type(e).__name__}: {str(e)[:800]}"
      if mode == "eager" or isinstance(e, torch.cuda.OutOfMemoryError):
        row = {"batch": b, "error": error}
      else:
        log(f"torch {a.shape} batch {b}: {mode} failed ({error[:300]}); eager from here on")
        mode = "eager"
        try:
          row = dict(torch_batch(a, model, ids, mode), compile_error=error)
        except Exception as e2:  # e.g. out of memory: keep the other batches
          row = {"batch": b, "error": f"{type(e2).__name__}: {str(e2)[:800]}",
                 "compile_error": error}
    emit("row", side="torch", row=row)
    ids = None
    gc.collect()
    if dev.type == "cuda":
      torch.cuda.empty_cache()


# -- the orchestrating process --------------------------------------------------------------------

def child_env(a, side: str) -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if side == "torch" or a.device == "cpu":  # jax stays off the device in the torch child
    env["JAX_PLATFORMS"] = "cpu"
  return env


def run_child(a, side: str, shape: str, ckpt: str, on_event) -> int:
  """Runs this file as the `side` child for `shape`, its lines echoed and its tagged results
  passed to `on_event`; returns its exit code (the child is ended if this process stops)."""
  left = a.budget_s - (time.perf_counter() - bench_gpu.START)
  cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--shape", shape,
         "--ckpt", ckpt, "--batches", *map(str, a.batches), "--prompt-len", str(a.prompt_len),
         "--new-tokens", str(a.new_tokens), "--dtype", a.dtype, "--device", a.device,
         "--torch-compile", a.torch_compile, "--compare-tokens", str(a.compare_tokens),
         "--repeats", str(a.repeats), "--seed", str(a.seed), "--budget-s", f"{left:.1f}",
         "--out", os.devnull]
  tail = collections.deque(maxlen=40)
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=child_env(a, side), cwd=REPO)
  try:
    for line in proc.stdout:
      if line.startswith(TAG):
        on_event(json.loads(line[len(TAG):]))
        continue
      tail.append(line.rstrip())
      print(f"  {side:7s}| {line.rstrip()}", flush=True)
    rc = proc.wait()
  finally:
    if proc.poll() is None:
      proc.terminate()
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
  if rc:
    on_event({"event": "failed", "side": side, "rc": rc, "tail": list(tail)})
  return rc


def checkpoint_ready(path: str, want: dict) -> bool:
  """Whether `path` holds a checkpoint this script made for `want` (reused); False when there is
  none. Any other directory there is an error, never overwritten."""
  if not os.path.exists(path):
    return False
  try:
    with open(os.path.join(path, MARKER)) as f:
      marker = json.load(f)
  except (OSError, ValueError):
    marker = None
  if marker is None or {k: marker.get(k) for k in want} != want:
    raise UserError(f"peer_torch_gpu: {path} exists but is not a checkpoint this script made "
                    f"for {want} (no matching {MARKER}); move it away or pass another --work-dir")
  return True


def compare(a, shape: str, b: int, results: dict, greedy: dict) -> None:
  """The (shape, batch) comparison row: both sides' figures, their ratio, the greedy tokens."""
  import numpy as np

  rows = {side: next((r for r in results[side].get(shape, {}).get("rows", [])
                      if r["batch"] == b), {}) for side in SIDES}
  rec = {"batch": b}
  for key in ("step_ms", "tokens_per_s", "first_call_s", "peak_memory_gb"):
    for side in SIDES:
      rec[f"{side}_{key}"] = rows[side].get(key)
  rec["torch_compile_s"] = rows["torch"].get("compile_s")
  rec["torch_compile_mode"] = rows["torch"].get("compile_mode")
  if rec["specjax_step_ms"] and rec["torch_step_ms"]:
    rec["specjax_over_torch"] = rec["specjax_step_ms"] / rec["torch_step_ms"]
  if (shape, "specjax", b) in greedy and (shape, "torch", b) in greedy:
    (st, sl), (tt, tl) = greedy[(shape, "specjax", b)], greedy[(shape, "torch", b)]
    st, tt, sl, tl = (np.asarray(x) for x in (st, tt, sl, tl))
    n = min(st.shape[1], tt.shape[1])
    eq = st[:, :n] == tt[:, :n]
    first_diff = [None if r.all() else int(np.argmin(r)) for r in eq]
    prefix = np.array([n if d is None else d for d in first_diff])
    m = min(n, sl.shape[1], tl.shape[1])
    mask = np.arange(m)[None, :] < prefix[:, None]
    lp = np.abs(sl[:, :m] - tl[:, :m])[mask]
    rec["greedy"] = {"compared_tokens": n, "rows": int(eq.shape[0]),
                     "equal_tokens": int(eq.sum()), "total_tokens": int(eq.size),
                     "rows_equal": int(eq.all(1).sum()),
                     "first_diff": first_diff[:KEPT_ROWS],
                     "earliest_diff": min((d for d in first_diff if d is not None), default=None),
                     "logprob_max_abs_diff": float(lp.max()) if lp.size else None}
  out = [r for r in results["comparison"].get(shape, []) if r["batch"] != b] + [rec]
  results["comparison"][shape] = sorted(out, key=lambda r: a.batches.index(r["batch"]))


def run_shape(a, shape: str, work: str, own_dir: bool, results: dict) -> None:
  """The shape's checkpoint (made or reused), then each side in its own child."""
  if over_budget(a, shape, results):
    return
  want = {"shape": shape, "dims": SHAPES[shape], "dtype": a.dtype, "seed": a.seed}
  path = os.path.join(work, f"{shape}-{a.dtype}-seed{a.seed}")
  greedy = {}

  def on_event(ev: dict) -> None:
    kind, side = ev.pop("event"), ev.pop("side", None)
    if kind == "env":
      results["device"][side] = ev["device"]
    elif kind == "checkpoint":
      results["checkpoints"][shape] = dict(ev, reused=False)
      log(f"{shape}: checkpoint of {ev['params'] / 1e9:.2f}B parameters ({ev['gbytes']:.2f} GB) "
          f"built in {ev['build_s']:.1f} s, written in {ev['write_s']:.1f} s")
    elif kind == "load":
      results[side].setdefault(shape, {"rows": []}).update(ev)
      log(f"{shape} {side}: loaded in {ev['load_s']:.1f} s")
    elif kind == "row":
      row = ev["row"]
      b = row["batch"]
      if "greedy_tokens" in row:
        greedy[(shape, side, b)] = (row["greedy_tokens"], row["greedy_logprobs"])
        row["greedy_tokens"] = row["greedy_tokens"][:KEPT_ROWS]
        row["greedy_logprobs"] = row["greedy_logprobs"][:KEPT_ROWS]
      results[side].setdefault(shape, {"rows": []})["rows"].append(row)
      log(f"{shape} {side:7s} batch {b:4d}: " + (
          f"failed ({row['error'][:300]})" if "error" in row else
          f"{row['step_ms']:8.3f} ms/step  {row['tokens_per_s']:9.0f} tok/s  first call "
          f"{row['first_call_s']:6.1f} s" +
          (f"  compile {row['compile_s']:.1f} s ({row['compile_mode']}, {row['compiled_graphs']} "
           f"graphs, {row['cudagraph_skips']} CUDA-graph skips)" if side == "torch" else "")))
      compare(a, shape, b, results, greedy)
    elif kind == "skipped":
      results["skipped"].append(ev["what"])
    elif kind == "failed":
      results["errors"].append(dict(ev, side=side, shape=shape))
      log(f"{shape} {side}: the child failed (exit {ev['rc']})")
    write(a, results)

  try:
    if checkpoint_ready(path, want):
      with open(os.path.join(path, MARKER)) as f:
        results["checkpoints"][shape] = dict(json.load(f), reused=True, path=path)
      log(f"{shape}: reusing the checkpoint in {path}")
    elif run_child(a, "write", shape, path, on_event) or not os.path.isdir(path):
      return
    if not own_dir:
      results["checkpoints"][shape]["path"] = path
    write(a, results)
    for side in SIDES:
      if not over_budget(a, f"{side} {shape}", results):
        run_child(a, side, shape, path, on_event)
  finally:
    if own_dir:
      shutil.rmtree(path, ignore_errors=True)


def table(results: dict) -> str:
  """The comparison as a text table, one line per (shape, batch); sj/torch is specjax's ms per
  step over torch's (below 1: specjax's step is faster)."""
  def num(x, fmt):  # a missing figure: "-" in the column's width
    return format(x, fmt) if x is not None else "-".rjust(int(fmt.split(".")[0]))

  groups = (f"{'':17s} | {'ms per step':^27s} | {'tokens/s':^19s} | {'first call s':^16s} "
            f"{'torch':>7s} | {'peak GB':^15s} |")
  head = (f"{'shape':11s} {'batch':>5s} | {'specjax':>9s} {'torch':>9s} {'sj/torch':>8s} | "
          f"{'specjax':>9s} {'torch':>9s} | {'specjax':>8s} {'torch':>7s} {'compile':>7s} | "
          f"{'specjax':>7s} {'torch':>7s} | greedy tokens equal")
  lines = [groups, head, "-" * len(head)]
  for shape, rows in results["comparison"].items():
    for r in rows:
      g = r.get("greedy")
      same = "-" if g is None else (
          f"{g['equal_tokens']}/{g['total_tokens']} ({g['rows_equal']}/{g['rows']} rows)"
          + ("" if g["earliest_diff"] is None else f", first diff at {g['earliest_diff']}"))
      lines.append(
          f"{shape:11s} {r['batch']:5d} | {num(r['specjax_step_ms'], '9.3f')} "
          f"{num(r['torch_step_ms'], '9.3f')} {num(r.get('specjax_over_torch'), '8.2f')} | "
          f"{num(r['specjax_tokens_per_s'], '9.0f')} {num(r['torch_tokens_per_s'], '9.0f')} | "
          f"{num(r['specjax_first_call_s'], '8.1f')} {num(r['torch_first_call_s'], '7.1f')} "
          f"{num(r['torch_compile_s'], '7.1f')} | {num(r['specjax_peak_memory_gb'], '7.2f')} "
          f"{num(r['torch_peak_memory_gb'], '7.2f')} | {same}")
  return "\n".join(lines)


def _stop(signum, frame):
  raise SystemExit(128 + signum)  # a stop on SIGTERM still removes the checkpoints and the child


def main(argv=None) -> dict | None:
  a = parse_args(argv)
  bench_gpu.START = time.perf_counter()  # the clock of log, over_budget and write: this run's
  if a.side is not None:
    {"write": side_write, "specjax": side_specjax, "torch": side_torch}[a.side](a)
    return None
  results = {"partial": True, "args": vars(a),
             "command": "python experiments/peer_torch_gpu.py " +
                        " ".join(sys.argv[1:] if argv is None else argv),
             "torch_compile": a.torch_compile, "device": {}, "checkpoints": {},
             "specjax": {}, "torch": {}, "comparison": {}, "skipped": [], "errors": []}
  write(a, results)
  own_dir = a.work_dir is None
  work = tempfile.mkdtemp(prefix="peer_torch_gpu-") if own_dir else os.path.abspath(a.work_dir)
  os.makedirs(work, exist_ok=True)
  try:
    previous = signal.signal(signal.SIGTERM, _stop)
  except ValueError:  # not the main thread: no handler
    previous = None
  try:
    for shape in a.shapes:
      run_shape(a, shape, work, own_dir, results)
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    if own_dir:
      shutil.rmtree(work, ignore_errors=True)
  results["partial"] = False
  write(a, results)
  print(table(results), flush=True)
  log(f"done: {a.out}")
  return results


if __name__ == "__main__":
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
