"""The rollout engine on the host: chains segment programs (`specjax.sampling.segment`) with
live-batch compaction into power-of-two buckets (`buckets.py`), an attention window over the
live prefix, and a draft length chosen per bucket (`adaptive.py`) from measured step costs
(`calibration.py`) and running acceptance rates.

Why: RL completions have long-tailed lengths, so most decode steps run with few live rows; a
verify of K+1 tokens is nearly free only while the live batch is small (weight reads dominate),
and costs K+1 steps once arithmetic dominates. A fixed K and a fixed batch cannot follow that.
Every choice here depends only on timings and on tokens already emitted, so every step is
verified exactly as in the static loop: the output keeps the target's distribution.

One object per role, each in its own module:

- `host_loop.EngineRun`: the loop between segments (asks the others, runs a segment, logs it);
- `scheduler.Scheduler`: waiting rows, refills of free slots, when a segment returns;
- `kv`: the KV manager, dense (`DenseKV`) or paged (`PagedKVManager`: the pool, placement over
  data-parallel replicas, swapping; its host bookkeeping in `slot_pages`, its device programs in
  `paged_state`);
- `batch.Batch`: the device state and every program that takes (donates) it;
- `programs`: the compiled programs, compiling ahead, and the count of compiled programs;
- `speculation.Speculation`: K and tree choice, calibration of step costs, what a segment
  teaches.
"""

from specjax.sampling.engine.host_loop import EngineRun, params_mesh, run_engine
from specjax.sampling.engine.programs import PROGRAMS, compiled_programs, program_statics

__all__ = ["EngineRun", "PROGRAMS", "compiled_programs", "params_mesh", "program_statics",
           "run_engine"]
