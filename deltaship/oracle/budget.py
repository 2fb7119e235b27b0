"""The reference's memory budget: whether the fp32 transformers reference fits this machine.

Verification, the KV-cache calibration and the ExecuTorch lowering's dequantized weight copy each run (or keep
something for) the reference only when it fits; this is the one rule they share. Nothing here imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

MEMORY_FRACTION = 0.6  # the fp32 reference may use at most this share of available memory


def available_memory() -> int:
    """MemAvailable (bytes), or the physical memory where /proc/meminfo cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def reference_need(spec) -> int:
    """Bytes the fp32 transformers reference needs (weights plus working memory)."""
    return int(spec.parameter_count()["total"] * 4 * 1.3)


def reference_fits(spec) -> bool:
    return reference_need(spec) <= MEMORY_FRACTION * available_memory()
