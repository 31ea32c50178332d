"""The GPU's clock, power and clock-event reasons while a segment of steps ran (NVML, sampled on a thread).

``bench/interleaved.py --clocks`` wraps each side's timed steps in one: does a row that copies
beside compute run at a lower SM clock than resident (power drawn by the copies), on a machine and
in a process where it is slower?  Reasons are NVML's clock-event bits (``nvmlClocksEventReason*``
in nvml.h): power cap 0x4, hardware slowdown 0x8, software thermal 0x20, hardware thermal 0x40,
power brake 0x80.
"""

from __future__ import annotations

import statistics
import threading
import time

REASONS = {"power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40, "power_brake": 0x80}


class ClockSampler:
    """Samples (time, SM MHz, memory MHz, power W, reasons) every ``period_s`` until ``stop()``."""

    def __init__(self, index: int = 0, period_s: float = 0.02):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle, self.period = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index), period_s
        self.reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self.samples: list[tuple[float, int, int, float, int]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nvml, h = self.nvml, self.handle
        while not self._done.wait(self.period):
            self.samples.append((time.perf_counter(), nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
                                 nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
                                 nvml.nvmlDeviceGetPowerUsage(h) / 1e3, self.reasons(h)))

    def window(self, start: float, end: float) -> dict:
        """Means over the samples taken between ``start`` and ``end`` (``time.perf_counter``), and the
        share of them with each clock-event reason set."""
        rows = [s for s in self.samples if start <= s[0] <= end]
        if not rows:
            return {"samples": 0}
        return {"samples": len(rows), "sm_mhz": round(statistics.mean(r[1] for r in rows), 1),
                "sm_mhz_min": min(r[1] for r in rows), "mem_mhz": round(statistics.mean(r[2] for r in rows), 1),
                "power_w": round(statistics.mean(r[3] for r in rows), 1),
                **{name: round(sum(bool(r[4] & bit) for r in rows) / len(rows), 3) for name, bit in REASONS.items()}}

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
