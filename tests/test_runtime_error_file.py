"""The workers' torchelastic error file is written whole or not at all (``dtprobe.runtime.error_file``): an empty
``error.json`` left by a worker killed mid-write makes torchrun's agent exit instead of restarting the job."""

from __future__ import annotations

import json
import os
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dtprobe.runtime import error_file


def test_an_uncaught_exception_writes_an_error_file_torchelastic_parses(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @error_file.record
    def main() -> None:
        raise RuntimeError("gloo: connection closed by peer")

    with pytest.raises(RuntimeError):
        main()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "RuntimeError: gloo: connection closed by peer"
    assert "in main" in failure.message["extraInfo"]["py_callstack"] and failure.timestamp > 0
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]


def test_a_worker_killed_while_writing_leaves_no_error_file(tmp_path, monkeypatch):
    # The stop lands after the file was opened and before its text is written (SIGTERM's handler running there)
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    real_open = open

    class Killed(BaseException):
        pass

    class StopBeforeWrite:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise Killed(signal.SIGTERM)

    real_fdopen = os.fdopen
    # either way of opening a file for the text (torch's handler opens the path; a temporary file is an fd)
    monkeypatch.setattr("builtins.open", lambda p, mode="r", *a, **k: StopBeforeWrite(real_open(p, mode, *a, **k)))
    monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: StopBeforeWrite(real_fdopen(fd, mode, *a, **k)))

    @error_file.record
    def main() -> None:
        raise RuntimeError("gloo: connection closed by peer")

    with pytest.raises(Killed):
        main()
    monkeypatch.setattr("builtins.open", real_open)
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert not path.exists()                  # torchrun's agent sees no error data rather than a broken file
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path))
    assert "Signal 15" in failure.message        # parsed: the agent goes on to restart the job


def test_torchs_own_handler_leaves_the_empty_file_that_breaks_the_agent(tmp_path):
    # What the atomic write prevents: the agent cannot parse an empty error file and raises
    path = tmp_path / "error.json"
    path.write_text("")
    with pytest.raises(json.JSONDecodeError):
        ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path))
