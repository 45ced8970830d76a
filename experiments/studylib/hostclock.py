"""How much CPU the host gave a run: wall time alone cannot tell a slow run from a busy host.

A shared VM loses CPU time to its hypervisor ("steal": the eighth figure of `/proc/stat`'s
`cpu` line, counted while the VM wanted to run and the host ran someone else). Then the same
study takes more wall time for the same CPU time, so the study records both:

    clock = HostClock.start()
    ...                                # train, decode
    summary = clock.summary()  # {"wall_s", "process_cpu_s", "host_steal_frac" (None off Linux)}
    summary_text(summary)      # "1653 s total, 1405 CPU-s in this process, 24% of the host's
                               #  CPU stolen by its hypervisor"

`process_cpu_s` is this process's CPU time over every thread (XLA's included); on an n-core
host it is up to n times the wall time. `host_steal_frac` is the stolen share of all the host's
CPU time over the run (every core, every process), so it is comparable between runs.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def cpu_ticks(proc_stat_text: str) -> tuple[int, int] | None:
  """(total, steal) clock ticks of the aggregate `cpu` line of /proc/stat text, or None
  when it has no such line (or too few fields to carry steal)."""
  for line in proc_stat_text.splitlines():
    fields = line.split()
    if fields and fields[0] == "cpu":
      ticks = [int(f) for f in fields[1:]]
      if len(ticks) < 8:
        return None
      # guest and guest_nice (fields 9-10) are already counted in user and nice.
      return sum(ticks[:8]), ticks[7]
  return None


def _read_ticks() -> tuple[int, int] | None:
  try:
    return cpu_ticks(PROC_STAT.read_text())
  except OSError:  # not Linux, or /proc not mounted
    return None


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None):
  """Stolen share of the host's CPU ticks between two `cpu_ticks` readings (None if either
  is missing or no tick passed)."""
  if before is None or after is None or after[0] <= before[0]:
    return None
  return (after[1] - before[1]) / (after[0] - before[0])


@dataclasses.dataclass(frozen=True)
class HostClock:
  """Wall time, process CPU time and host CPU ticks at one moment (`start`)."""
  wall: float
  cpu: float
  ticks: tuple[int, int] | None

  @classmethod
  def start(cls) -> HostClock:
    return cls(time.perf_counter(), time.process_time(), _read_ticks())

  def summary(self) -> dict:
    """{"wall_s", "process_cpu_s", "host_steal_frac"} from `start` until now."""
    return {"wall_s": time.perf_counter() - self.wall,
            "process_cpu_s": time.process_time() - self.cpu,
            "host_steal_frac": steal_fraction(self.ticks, _read_ticks())}


def summary_text(summary: dict) -> str:
  """One phrase for a log line, e.g. '1653 s total, 1405 CPU-s in this process, 24% of the
  host's CPU stolen by its hypervisor'."""
  text = (f"{summary['wall_s']:.0f} s total, {summary['process_cpu_s']:.0f} CPU-s in this "
          "process")
  if summary.get("host_steal_frac") is not None:
    text += f", {100 * summary['host_steal_frac']:.0f}% of the host's CPU stolen by its hypervisor"
  return text
