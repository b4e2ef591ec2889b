"""Tests of the cost model and automatic placement (pure Python, no process group)."""
