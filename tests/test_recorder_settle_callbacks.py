"""``CollectiveRecorder.settle_callbacks`` (run at interpreter exit): it waits until every finished work's future has
let go of the recorder's done-callback (a gloo thread that still needs the GIL once the interpreter finalizes aborts
the process), and does not wait for a work still in flight."""

from __future__ import annotations

import threading
import time

from dtprobe.collectors.collective_recorder import CollectiveRecorder
from dtprobe.collectors.recorded_work import FutureDone


class _Future:
    """A future whose done-callbacks are run and then released on another thread, as a gloo worker does."""

    def __init__(self) -> None:
        self.callbacks: list = []
        self.finished = False

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def done(self) -> bool:
        return self.finished

    def wait(self):
        return None

    def value(self):
        return None

    def finish_later(self, *, release_after_s: float) -> threading.Thread:
        def run() -> None:
            self.finished = True                  # the waiter may go on from here
            for callback in self.callbacks:
                callback(self)
            time.sleep(release_after_s)
            self.callbacks.clear()                # the worker thread lets go of the callbacks
        thread = threading.Thread(target=run)
        thread.start()
        return thread


def _register(recorder: CollectiveRecorder) -> _Future:
    future = _Future()
    row = {"pg": "world", "seq": 1, "op": "allreduce", "num_bytes": 4, "dtype": "float32", "step": 0,
           "timing": "host", "enqueue_ns": time.time_ns(), "restart": 0}
    recorder.on_done(future, FutureDone(recorder, recorder.track(row), row))
    return future


def test_settle_waits_until_a_finished_works_callback_is_released():
    recorder = CollectiveRecorder()
    future = _register(recorder)
    thread = future.finish_later(release_after_s=0.3)
    while not future.finished:
        time.sleep(0.001)
    assert recorder.settle_callbacks(timeout_s=10) is True
    assert future.callbacks == []                 # returned only once the callback was let go of
    thread.join()


def test_settle_does_not_wait_for_a_work_still_in_flight_and_gives_up_after_its_timeout():
    recorder = CollectiveRecorder()
    in_flight = _register(recorder)               # never finishes (a hung collective)
    t0 = time.monotonic()
    assert recorder.settle_callbacks(timeout_s=10) is True and time.monotonic() - t0 < 1
    stuck = _register(recorder)
    stuck.finished = True                         # finished, but its thread never lets go of the callback
    assert recorder.settle_callbacks(timeout_s=0.2) is False
    assert in_flight.callbacks and stuck.callbacks
