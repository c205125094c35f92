"""``MemoryUsage``: this process's resident host memory and its device memory, at one moment."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes resident in host memory (RSS) and allocated on the device (0 on CPU)."""

    rss: int
    device: int

    @classmethod
    def now(cls, device: torch.device) -> MemoryUsage:
        with open("/proc/self/statm", encoding="ascii") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        on_device = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        return cls(rss, on_device)

    def report(self, after: MemoryUsage) -> dict[str, int]:
        """Before (this) and after, as sent to the engine."""
        return {"rss_before": self.rss, "rss_after": after.rss,
                "device_before": self.device, "device_after": after.device}
