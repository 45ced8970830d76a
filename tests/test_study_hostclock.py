"""The study's host clock: /proc/stat parsing, the steal share and the log phrase."""

import time

import pytest

from studylib import hostclock

# A 2-core VM's /proc/stat head: user nice system idle iowait irq softirq steal guest guest_nice.
STAT = """cpu  2605456 0 164616 5782404 3144 0 3710 76187 11 0
cpu0 1300443 0 82457 2892583 1776 0 1736 38450 0 0
intr 123 0
"""


def test_cpu_ticks_reads_the_aggregate_line():
  total = 2605456 + 164616 + 5782404 + 3144 + 3710 + 76187  # guest is already in user
  assert hostclock.cpu_ticks(STAT) == (total, 76187)
  assert hostclock.cpu_ticks("cpu0 1 2 3 4 5 6 7 8\n") is None  # no aggregate line
  assert hostclock.cpu_ticks("cpu 1 2 3 4\n") is None           # a kernel without steal


def test_steal_fraction_between_two_readings():
  assert hostclock.steal_fraction((1000, 100), (2000, 350)) == pytest.approx(0.25)
  assert hostclock.steal_fraction(None, (2000, 350)) is None
  assert hostclock.steal_fraction((1000, 100), (1000, 100)) is None  # no tick passed


def test_summary_counts_this_process_cpu_and_the_text_names_the_steal(monkeypatch):
  readings = iter([(1000, 100), (3000, 600)])
  monkeypatch.setattr(hostclock, "_read_ticks", lambda: next(readings))
  clock = hostclock.HostClock.start()
  end = time.process_time() + 0.05
  while time.process_time() < end:  # 50 ms of this process's CPU
    pass
  summary = clock.summary()
  assert summary["host_steal_frac"] == pytest.approx(0.25)
  assert summary["process_cpu_s"] >= 0.05 and summary["wall_s"] >= 0.04
  text = hostclock.summary_text({"wall_s": 1653.2, "process_cpu_s": 1405.4,
                                 "host_steal_frac": 0.245})
  assert text == ("1653 s total, 1405 CPU-s in this process, 24% of the host's CPU stolen "
                  "by its hypervisor")
  assert hostclock.summary_text({"wall_s": 2, "process_cpu_s": 3, "host_steal_frac": None}) == (
      "2 s total, 3 CPU-s in this process")
