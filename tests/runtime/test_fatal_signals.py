"""A rank that dies of a signal in native code says where, in Python, it died."""

from __future__ import annotations

import subprocess
import sys

CRASH = """
import ctypes
from megatron_rlhf.runtime.bootstrap import report_fatal_signals

def read_from_address_zero():
    ctypes.string_at(0)

report_fatal_signals()
read_from_address_zero()
"""


def test_a_segfault_prints_the_python_stack() -> None:
    crashed = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True,
                             timeout=120)
    assert crashed.returncode == -11
    assert "Fatal Python error: Segmentation fault" in crashed.stderr
    assert "in read_from_address_zero" in crashed.stderr, crashed.stderr


def test_without_it_the_log_says_nothing() -> None:
    silent = subprocess.run([sys.executable, "-c", CRASH.replace("report_fatal_signals()\n", "")],
                            capture_output=True, text=True, timeout=120)
    assert silent.returncode == -11
    assert "read_from_address_zero" not in silent.stderr
