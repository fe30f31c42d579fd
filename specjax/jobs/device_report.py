"""What one run of the experiment cost its device: the train step's model FLOPs utilisation, the
peak device memory, the seconds spent compiling, and generation's share of the step.

Model FLOPs are the policy's forward and backward over the positions the packed train step
trained on (3 x (2 x the parameters its matmuls touch per token, LM head included, + causal
attention's query-key pairs)), over the train phase's time, against the device's dense bf16
peak from the simulator's catalog; the draft head's online loss and the packing's padding cost
time and add no FLOPs. Devices outside the catalog (the CPU) get the achieved rate, no MFU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MFU_NOTE = ("train MFU: the policy's forward+backward model FLOPs over the trained sequences' "
            "positions (6 x matmul parameters per token, LM head included, + causal attention) "
            "per second of the train phase, over the device's dense bf16 peak (steps that "
            "compiled left out); the draft head's online loss and packing padding add time, "
            "not FLOPs")


def policy_spec(model_cfg):
  """The simulator's ModelSpec of a specjax ModelConfig (dense decoder)."""
  from specjax.sim.catalog import ModelSpec

  return ModelSpec(name="policy", hidden=model_cfg.hidden_size, layers=model_cfg.num_layers,
                   heads=model_cfg.num_heads, kv_heads=model_cfg.num_kv_heads,
                   head_dim=model_cfg.head_dim, intermediate=model_cfg.mlp_hidden,
                   vocab=model_cfg.vocab_size, tie_embeddings=model_cfg.tie_embeddings)


def train_step_flops(model_cfg, tokens: float, attention_pairs: float) -> float:
  """Model FLOPs of a forward and backward over `tokens` positions with `attention_pairs`
  causal (query, key) pairs."""
  spec = policy_spec(model_cfg)
  return 3.0 * (2.0 * spec.active_params * tokens + spec.attn_flops_per_pair * attention_pairs)


def peak_bf16_flops(device_kind: str) -> float | None:
  """The device's dense bf16 peak (the simulator's catalog), or None for a device it lacks."""
  from specjax.sim.bench_data import hardware_of_device
  from specjax.sim.catalog import get_hardware

  try:
    return get_hardware(hardware_of_device(device_kind)).flops
  except ValueError:
    return None


def device_stats(steps: list[dict], compiled: list[bool], model_cfg, device_kind: str,
                 dtype: str) -> dict[str, Any]:
  """One run's device figures from its step records (`compiled`: the compile mask)."""
  timed = [r for r, c in zip(steps, compiled) if not c] or steps
  trained = [r for r in timed if r.get("train/tokens", 0) > 0 and r.get("time/train", 0) > 0]
  out: dict[str, Any] = {
      "device_kind": device_kind,
      "first_step_compile_s": steps[0].get("perf/compile_s") if steps else None,
      "compile_s_total": float(sum(r.get("perf/compile_s", 0.0) for r in steps)),
      "peak_device_gib": max((r["perf/peak_device_gib"] for r in steps
                              if r.get("perf/peak_device_gib") is not None), default=None),
      "train_model_tflops_per_s": None, "train_mfu": None,
  }
  gen = sum(r.get("time/gen", 0.0) for r in timed)
  total = sum(r.get("time/step", 0.0) for r in timed)
  out["gen_share_of_step"] = gen / total if total > 0 else None
  if model_cfg is not None and trained:
    flops = sum(train_step_flops(model_cfg, r["train/tokens"], r.get("train/attention_pairs", 0))
                for r in trained)
    rate = flops / sum(r["time/train"] for r in trained)
    out["train_model_tflops_per_s"] = rate / 1e12
    peak = peak_bf16_flops(device_kind)
    if peak is not None and dtype == "bfloat16":
      out["train_mfu"] = rate / peak
  return out


def format_device_lines(runs: dict[str, dict]) -> list[str]:
  """The report's lines of each run's device figures."""
  def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)

  lines = []
  for label, s in runs.items():
    d = s.get("device")
    if not d:
      continue
    lines.append(f"{label} on {d['device_kind']}: train {fmt(d['train_model_tflops_per_s'], '.2f')}"
                 f" model TFLOP/s (MFU {fmt(d['train_mfu'], '.1%')}), peak device memory "
                 f"{fmt(d['peak_device_gib'], '.1f')} GiB, first step compiled for "
                 f"{fmt(d['first_step_compile_s'], '.1f')} s, generation "
                 f"{fmt(d['gen_share_of_step'], '.0%')} of the step")
  return lines
