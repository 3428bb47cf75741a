"""The expected XLA lines of a compile-only report are kept off stderr (fd 2), with one note; others pass."""

import os
import sys

import pytest

from jaxserve.tools.xla_log_filter import filtered_xla_logs

pytestmark = pytest.mark.quick

SCHEDULE = (b"E1203 17:30:56.614019    8931 gpu_hlo_schedule.cc:1068] The byte size of input/output arguments "
            b"(72631362456) exceeds the base limit (67943478067). This indicates an error in the calculation!\n")
REMAT = (b"W1203 17:30:56.945941    8931 hlo_rematerialization.cc:3363] Can't reduce memory use below 52.68GiB "
         b"(56570315408 bytes) by rematerialization; only reduced to 52.69GiB\n")
OTHER = b"E1203 17:31:00.000000    8931 gpu_compiler.cc:1] something else went wrong\n"


def test_expected_lines_are_dropped_and_counted_others_pass(capfd):
    with filtered_xla_logs() as counts:
        os.write(2, SCHEDULE + OTHER + REMAT + SCHEDULE)
        print("python's own stderr", file=sys.stderr)
    err = capfd.readouterr().err
    assert counts == {"scheduler memory budget": 2, "rematerialization budget": 1}
    assert "exceeds the base limit" not in err and "Can't reduce memory" not in err
    assert "something else went wrong" in err and "python's own stderr" in err
    assert "note: 3 expected XLA log lines not shown (2 about the scheduler memory budget, 1 about the " \
           "rematerialization budget)" in err
    os.write(2, SCHEDULE)  # fd 2 is itself again
    assert "exceeds the base limit" in capfd.readouterr().err


def test_no_note_when_nothing_was_dropped(capfd):
    with filtered_xla_logs():
        os.write(2, OTHER)
    err = capfd.readouterr().err
    assert err == OTHER.decode()
