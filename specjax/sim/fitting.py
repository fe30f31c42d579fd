"""The one fit of the simulator: efficiency factors by damped least squares (Levenberg-Marquardt)
on log(predicted / measured), ridge-pulled to their start values, within per-field bounds.

Cases are anything with `predict(eff)`, `seconds` and `weight`: the paper's measurements
(`calibrate`) and a machine's own runs (`machine_fit`) both fit here.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specjax.sim.cost import Efficiency

# Plausible ranges of the GPU factors (a machine fit adds or narrows its own).
BOUNDS = {"bw": (0.2, 1.0), "flops": (0.1, 1.0), "step_overhead_s": (1e-5, 0.05),
          "draft_overhead_s": (1e-6, 0.02), "mfu": (0.05, 0.8), "comm": (0.1, 1.0),
          "host_ngram_s_per_token": (1e-12, 1e-6), "prepare_overhead_s": (1e-3, 120.0),
          "other_s": (1e-3, 120.0), "logit_s": (1e-14, 1e-8), "kv_bw": (0.05, 1.0)}


def _residuals(cases, eff, fields, x, prior, ridge):
  e = eff.replace(**{f: float(math.exp(v)) for f, v in zip(fields, x)})
  fit = [math.sqrt(c.weight) * math.log(c.predict(e) / c.seconds) for c in cases]
  pull = [math.sqrt(ridge) * (v - p) for v, p in zip(x, prior)]
  return np.array(fit + pull)


def fit_factors(cases: Sequence, start: Efficiency, fields: Sequence[str], bounds: dict,
                ridge: float = 1e-3, iters: int = 40) -> Efficiency:
  """Levenberg-Marquardt on log-parameters (finite-difference Jacobian) minimising
  sum_i w_i log(pred_i / measured_i)^2 + ridge * sum_j log(x_j / start_j)^2 within `bounds`.
  The small ridge keeps directions the cases do not constrain at their start values."""
  for f in fields:
    if f not in bounds:
      raise ValueError(f"fit_efficiency: field {f!r} is not fittable; choose from {sorted(bounds)}")
  lo = np.log([bounds[f][0] for f in fields])
  hi = np.log([bounds[f][1] for f in fields])
  # (a factor that starts at 0 or unset, e.g. logit_s or kv_bw, starts midway between its
  # bounds in log scale)
  prior = np.clip([math.log(getattr(start, f)) if (getattr(start, f) or 0) > 0 else (a + b) / 2
                   for f, a, b in zip(fields, lo, hi)], lo, hi)
  x = prior.copy()
  r = _residuals(cases, start, fields, x, prior, ridge)
  lam = 1e-2
  for _ in range(iters):
    jac = np.empty((len(r), len(x)))
    for j in range(len(x)):
      dx = np.zeros_like(x)
      dx[j] = 1e-4 if x[j] + 1e-4 <= hi[j] else -1e-4
      jac[:, j] = (_residuals(cases, start, fields, x + dx, prior, ridge) - r) / dx[j]
    jtj, jtr = jac.T @ jac, jac.T @ r
    improved = False
    for _ in range(8):
      step = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-9), -jtr)
      x_new = np.clip(x + step, lo, hi)
      r_new = _residuals(cases, start, fields, x_new, prior, ridge)
      if r_new @ r_new < r @ r:
        converged = r @ r - r_new @ r_new < 1e-10
        x, r, lam, improved = x_new, r_new, lam / 3, True
        break
      lam *= 4
    if not improved or converged:
      break
  return start.replace(**{f: float(math.exp(v)) for f, v in zip(fields, x)})
