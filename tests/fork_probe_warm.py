"""Imported by the agent as a warm module in ``test_fork_start.py``: registers an ``atexit`` function a forked
worker must keep (a fresh worker's imports would register it too)."""

import atexit

atexit.register(print, "warm atexit ran")
