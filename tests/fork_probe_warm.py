"""Imported by the agent as a warm module in ``test_fork_start.py``: registers an ``atexit`` function a forked
worker must keep (a fresh worker's imports would register it too), and has a lock that a thread of the agent holds
while the workers start (``LOCK``): a worker must not inherit it held."""

import atexit
import threading

atexit.register(print, "warm atexit ran")
LOCK = threading.Lock()
