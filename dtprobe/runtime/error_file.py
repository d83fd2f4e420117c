"""torchelastic's ``@record`` for dtprobe's worker entry points, with the error file written whole or not at all.

torch 2.13's ``ErrorHandler`` opens the error file, then writes it. A worker that raises while its attempt is being
stopped (a peer died: its collective fails, and the agent SIGTERMs it at the same time) can be killed between
the two: the agent then finds an empty ``error.json``, fails to parse it and exits itself ("Failed to parse reply
file"), so the job is not restarted although restarts were left. Written to a temporary name and renamed, the file
is either complete or absent; an absent one the agent handles (no error data for that worker).
"""

from __future__ import annotations

import json
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as _record

from dtprobe.store.manifest import write_text_atomically

_F = TypeVar("_F", bound=Callable)


class AtomicErrorHandler(ErrorHandler):
    """``ErrorHandler`` whose error file appears only once written."""

    def record_exception(self, e: BaseException) -> None:
        """The error file torchelastic's agent reads (``{"message": {"message": "<Type>: <text>", "extraInfo":
        {"py_callstack", "timestamp"}}}``), written whole."""
        file = self._get_error_file_path()
        if file:
            data = {"message": {"message": f"{type(e).__name__}: {e}",
                                "extraInfo": {"py_callstack": traceback.format_exc(),
                                              "timestamp": str(int(time.time()))}}}
            self._write_error_file(file, json.dumps(data))

    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        try:
            write_text_atomically(Path(file_path), error_msg)
        except OSError as e:
            warnings.warn(f"Unable to write error to file {file_path}: {e}", stacklevel=2)


def record(fn: _F) -> _F:
    """torchelastic's ``record`` on ``fn`` with ``AtomicErrorHandler``."""
    return _record(fn, error_handler=AtomicErrorHandler())
