"""scripts/step_files.py counts what one decode step runs in its own thread, not in the process's others."""

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from step_files import _calls_in_this_thread  # noqa: E402


def _elsewhere() -> None:
    pass


def _here() -> None:
    pass


def test_calls_in_other_threads_are_not_counted():
    """A daemon thread another part of the process left running (a disaggregated decode engine's prefill
    prober) calls code while the step runs; only the calling thread's functions are the step's. cProfile from
    Python 3.12 saw both, and the bound on the step's files failed when a prober woke inside the step."""
    stop, started = threading.Event(), threading.Event()

    def loop():
        started.set()
        while not stop.is_set():
            _elsewhere()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    started.wait()
    try:
        ran = _calls_in_this_thread(lambda: (_here(), stop.wait(0.05)))
    finally:
        stop.set()
        thread.join()
    names = {name for _, name in ran}
    assert "_here" in names and "_elsewhere" not in names
