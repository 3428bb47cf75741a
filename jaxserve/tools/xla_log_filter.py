"""XLA's log lines that a compile-only report expects and that say nothing is wrong, kept off stderr.

The KV pool is sized to fill the device's memory on purpose (``--hbm-utilization``). XLA:GPU's scheduler budgets
80% of the device memory for a program and its arguments; when the arguments alone (weights and the pool) are
larger, it logs an ``E`` line ("The byte size of input/output arguments ... exceeds the base limit ... This
indicates an error in the calculation!") and schedules within its budget anyway, and the rematerialization pass
warns that it cannot get under that budget. Neither changes the program. ``filtered_xla_logs`` drops exactly
these lines from file descriptor 2 (where XLA's C++ logging writes) while it is open, passes every other line
through, and prints one note with the count at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

# (what the note calls the lines, the pattern of one)
EXPECTED = (
    ("scheduler memory budget", re.compile(rb"gpu_hlo_schedule\.cc:\d+\] The byte size of input/output arguments "
                                           rb"\(\d+\) exceeds the base limit")),
    ("rematerialization budget", re.compile(rb"hlo_rematerialization\.cc:\d+\] Can't reduce memory use below")),
)


@contextlib.contextmanager
def filtered_xla_logs(note: bool = True) -> Iterator[dict[str, int]]:
    """Drop ``EXPECTED`` lines from fd 2 inside the block; yields the counts by kind (filled on exit)."""
    counts = {name: 0 for name, _ in EXPECTED}
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                kind = next((name for name, pattern in EXPECTED if pattern.search(line)), None)
                if kind is None:
                    os.write(saved, line)
                else:
                    counts[kind] += 1

    thread = threading.Thread(target=pump, name="xla-log-filter", daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the pump reads to its end
        thread.join(timeout=10)
        os.close(saved)
        dropped = {k: v for k, v in counts.items() if v}
        if note and dropped:
            what = ", ".join(f"{v} about the {k}" for k, v in dropped.items())
            print(f"note: {sum(dropped.values())} expected XLA log lines not shown ({what}): the KV pool fills the "
                  "device memory on purpose (jaxserve/tools/xla_log_filter.py)", file=sys.stderr, flush=True)
