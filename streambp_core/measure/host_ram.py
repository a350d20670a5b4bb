"""Host RAM: what the machine has available now, for checks that refuse a CPU run too big for it (before
it allocates until the machine dies)."""

from __future__ import annotations

import os


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo, else physical pages available (sysconf)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
