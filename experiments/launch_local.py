"""Start N local processes of one command as a jax.distributed job (coordinator 127.0.0.1).

  python experiments/launch_local.py -n 2 --cpu-devices 2 -- python my_script.py --flag
Each child gets SPECJAX_COORDINATOR / SPECJAX_NUM_PROCESSES / SPECJAX_PROCESS_ID (read by
`specjax.sharding.initialize_distributed()`); output is streamed with a `[pK]` prefix. If any
child fails or the timeout passes, all are killed; the exit status is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(process_id: int, num_processes: int, coordinator: str,
              cpu_devices: int | None) -> dict[str, str]:
  env = dict(os.environ)
  env.update(SPECJAX_COORDINATOR=coordinator, SPECJAX_NUM_PROCESSES=str(num_processes),
             SPECJAX_PROCESS_ID=str(process_id), PYTHONUNBUFFERED="1")
  if cpu_devices is not None:
    # Replace (not append to) any inherited fake-device count.
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={cpu_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
  return env


def _stream(proc: subprocess.Popen, prefix: str, out) -> None:
  for line in iter(proc.stdout.readline, b""):
    out.write(prefix + line.decode(errors="replace"))
    out.flush()


def _kill(procs: list[subprocess.Popen]) -> None:
  for proc in procs:
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)  # each child leads its own process group
      except ProcessLookupError:
        pass


def launch(command: list[str], num_processes: int, *, timeout_s: float = 600.0,
           cpu_devices: int | None = None, port: int | None = None, out=sys.stdout) -> int:
  """Run `command` as `num_processes` processes; 0 if all exit 0, else the first failure's code
  (124 on timeout)."""
  if num_processes < 1:
    raise ValueError(f"num_processes: must be >= 1, got {num_processes}")
  if not command:
    raise ValueError("command: nothing to run (put it after `--`)")
  coordinator = f"127.0.0.1:{port or free_port()}"
  procs, threads = [], []
  try:
    for pid in range(num_processes):
      proc = subprocess.Popen(command, env=child_env(pid, num_processes, coordinator, cpu_devices),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
      procs.append(proc)
      thread = threading.Thread(target=_stream, args=(proc, f"[p{pid}] ", out), daemon=True)
      thread.start()
      threads.append(thread)
    deadline = time.monotonic() + timeout_s
    status = 0
    while True:
      codes = [p.poll() for p in procs]
      failed = [c for c in codes if c not in (None, 0)]
      if failed:
        status = failed[0] if failed[0] > 0 else 128 - failed[0]  # killed by a signal
        out.write(f"[launch] a process exited with {status}; stopping the others\n")
        break
      if all(c == 0 for c in codes):
        break
      if time.monotonic() > deadline:
        status = 124
        out.write(f"[launch] timeout after {timeout_s:.0f} s; stopping all processes\n")
        break
      time.sleep(0.05)
  finally:
    _kill(procs)
    for proc in procs:
      proc.wait()
    for thread in threads:
      thread.join(timeout=5)
  return status


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  split = argv.index("--") if "--" in argv else len(argv)
  own, command = argv[:split], argv[split + 1:]
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                   usage="launch_local.py [-n N] [options] -- command ...")
  parser.add_argument("-n", "--num-processes", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds before all are killed")
  parser.add_argument("--cpu-devices", type=int, default=None,
                      help="run on CPU with this many fake devices per process")
  parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
  args = parser.parse_args(own)
  if not command:
    parser.error("no command: put it after `--`")
  # `kill <launcher>` (SIGTERM) unwinds through launch()'s cleanup and stops every child.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  return launch(command, args.num_processes, timeout_s=args.timeout, cpu_devices=args.cpu_devices,
                port=args.port)


if __name__ == "__main__":
  sys.exit(main())
