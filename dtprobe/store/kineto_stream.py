"""Stream ONE Kineto trace file as chunks of decoded events plus its top-level object; read by kineto_events.py.

A trace's ``traceEvents`` array is decoded a chunk of items at a time, so memory holds one chunk of text and its
events, never the whole file: the file (gzip or plain) is read in blocks, the array's text is cut after an item
and the items before the cut are decoded with ``msgspec`` typed structs that name only the fields dtprobe needs.
A cut is taken after a ``}`` followed by ``,`` or ``]``; it is only accepted when ``[<items before it>]`` decodes,
which is exactly when it falls between two items of the array (JSON is read deterministically from the array's
start, so a cut inside a string or a nested object leaves an unterminated value and fails to decode). The
top-level members before and after the array (``distributedInfo``, ``deviceProperties``, ...) are decoded
together at the end, with the array replaced by ``[]``.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgspec

from dtprobe.store.errors import TraceError

CHUNK_BYTES = 1 << 20
"""Bytes of (decompressed) JSON text decoded at a time."""

_KEY = b'"traceEvents"'
_WHITESPACE = frozenset(b" \t\r\n")
_COMMA, _CLOSE, _OPEN = ord(","), ord("]"), ord("[")
_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)")
_MAX_CUT_TRIES = 4
"""Candidate cuts tried before reading more text (a candidate fails only when it falls inside a string)."""
_MAX_END_TRIES = 16
"""``]`` positions tried at the end of the file for an array whose last item is not an object."""


# Decoded structs are not tracked by the cycle collector (``gc=False``: JSON cannot form cycles): a 50 MB trace
# decodes into ~400k of them, and the collector's passes over them would otherwise cost as much as the decoding.
class Args(msgspec.Struct, gc=False):
    """The ``args`` of an event that dtprobe reads."""

    stream: Any = None
    correlation: Any = None
    collective_name: Any = msgspec.field(default=None, name="Collective name")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    group_size: Any = msgspec.field(default=None, name="Group size")
    dtype: Any = None
    pg_name: Any = msgspec.field(default=None, name="Process Group Name")
    pg_desc: Any = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    seq: Any = msgspec.field(default=None, name="Seq")
    """The process group's own collective sequence number (recent PyTorch); None in older traces."""
    input_dims: msgspec.Raw = msgspec.field(default=None, name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=None, name="Input type")


class Event(msgspec.Struct, gc=False):
    """One item of ``traceEvents``, the fields dtprobe reads."""

    cat: Any = None
    name: Any = None
    ts: Any = None
    dur: Any = None
    tid: Any = None
    args: Args | None = None


class TraceFile(msgspec.Struct):
    """A trace file's top-level object."""

    traceEvents: list[Event] | None = None
    distributedInfo: Any = None
    deviceProperties: Any = None
    baseTimeNanoseconds: Any = None
    schemaVersion: Any = None


_FILE_DECODER = msgspec.json.Decoder(TraceFile)
_EVENTS_DECODER = msgspec.json.Decoder(list[Event])


def _gzip_error(path: Path, exc: BaseException) -> TraceError:
    return TraceError(
        f"{path}: corrupt or truncated gzip ({exc}). Copy the file again from where the profiler wrote it, "
        f"or re-record it; `gzip -t {path.name}` checks a copy.")


def _json_error(path: Path, exc: msgspec.MsgspecError) -> TraceError:
    if isinstance(exc, msgspec.ValidationError):
        return TraceError(
            f"{path}: not a Kineto trace ({exc}). Expected a JSON object with a 'traceEvents' list as written by "
            f"torch.profiler (tensorboard_trace_handler or export_chrome_trace).")
    return TraceError(
        f"{path}: invalid JSON ({exc}); the file is probably truncated (the profiler was killed while "
        f"writing it). Re-record the trace, or remove the file from the folder.")


def decode_file(path: Path, raw: bytes) -> TraceFile:
    """A whole trace file's text -> its top-level object; TraceError naming the file when it is not a trace."""
    try:
        doc = _FILE_DECODER.decode(raw)
    except msgspec.MsgspecError as exc:
        raise _json_error(path, exc) from None
    if doc.traceEvents is None:
        raise TraceError(
            f"{path}: no 'traceEvents' list, so this is not a Kineto/Chrome trace. Remove it from the folder or "
            f"export the profile with torch.profiler's export_chrome_trace.")
    return doc


class TraceEvents:
    """Iterate a trace file's events in chunks (lists of ``Event``); afterwards ``top`` holds the top-level
    object (``traceEvents`` empty) and ``num_events`` the number of items in ``traceEvents``.

    TraceError naming the file for I/O and gzip errors, invalid or truncated JSON and non-Kineto files.
    """

    def __init__(self, path: str | Path, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self.num_events = 0
        self.top: TraceFile | None = None

    def __iter__(self) -> Iterator[list[Event]]:
        try:
            fh: IO[bytes] = gzip.open(self.path, "rb") if self.path.name.endswith(".gz") else open(self.path, "rb")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot read the trace file ({exc.strerror or exc}).") from None
        with fh:
            yield from self._chunks(fh)

    def _read(self, fh: IO[bytes], size: int = -1) -> bytes:
        try:
            return fh.read(size)
        except (gzip.BadGzipFile, zlib.error, EOFError) as exc:
            raise _gzip_error(self.path, exc) from None
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot read the trace file ({exc.strerror or exc}).") from None

    def _chunks(self, fh: IO[bytes]) -> Iterator[list[Event]]:
        head, pending = self._head(fh)
        if head is None:    # no top-level traceEvents array: the whole (small or malformed) text is in pending
            doc = decode_file(self.path, pending)
            events, doc.traceEvents = doc.traceEvents, []
            self.num_events, self.top = len(events), doc
            if events:
                yield events
            return
        eof = False
        while True:
            while not eof and len(pending) < self.chunk_bytes:
                data = self._read(fh, self.chunk_bytes - len(pending))
                eof = not data
                pending += data
            events, rest, closed = self._cut(pending, eof=eof)
            if events is None:       # no item boundary in the text read so far: read more
                if eof:
                    self._raise_unterminated(pending)
                data = self._read(fh, self.chunk_bytes)
                eof = not data
                pending += data
                continue
            self.num_events += len(events)
            if events:
                yield events
            del events
            if closed:
                tail = rest + (b"" if eof else self._read(fh))
                try:
                    self.top = _FILE_DECODER.decode(head + b'"traceEvents":[]' + tail)
                except msgspec.MsgspecError as exc:
                    raise _json_error(self.path, exc) from None
                return
            pending = b"[" + rest

    def _head(self, fh: IO[bytes]) -> tuple[bytes | None, bytes]:
        """(the text before the top-level ``"traceEvents"`` key, the text after its ``[`` prefixed with ``[``), or
        (None, the whole text) when the file has no such array."""
        buf, start = b"", 0
        while True:
            at = buf.find(_KEY, start)
            if at < 0:
                data = self._read(fh, self.chunk_bytes)
                if not data:
                    return None, buf
                start = max(0, len(buf) - len(_KEY))
                buf += data
                continue
            colon = self._skip_space(fh, buf, at + len(_KEY))
            buf = colon[0]
            pos = colon[1]
            if pos < len(buf) and buf[pos] == ord(":"):
                buf, pos = self._skip_space(fh, buf, pos + 1)
                if pos < len(buf) and buf[pos] == _OPEN and self._is_top_level(buf[:at]):
                    return buf[:at], b"[" + buf[pos + 1:]
            start = at + 1

    def _skip_space(self, fh: IO[bytes], buf: bytes, pos: int) -> tuple[bytes, int]:
        """Advance ``pos`` past whitespace, reading more text when it runs out."""
        while True:
            while pos < len(buf) and buf[pos] in _WHITESPACE:
                pos += 1
            if pos < len(buf):
                return buf, pos
            data = self._read(fh, self.chunk_bytes)
            if not data:
                return buf, pos
            buf += data

    @staticmethod
    def _is_top_level(before: bytes) -> bool:
        """True when the key after ``before`` is a member of the top-level object (not inside another value)."""
        try:
            _FILE_DECODER.decode(before + b'"traceEvents":[]}')
        except msgspec.MsgspecError:
            return False
        return True

    def _cut(self, pending: bytes, *, eof: bool) -> tuple[list[Event] | None, bytes, bool]:
        """Decode the items of ``pending`` (``[`` + array text) up to its last item boundary: (events, the text
        after the boundary's separator, whether that separator closed the array); (None, b"", False) when no
        boundary is found."""
        tries = 0
        for end, sep in _object_ends(pending):
            try:
                events = _EVENTS_DECODER.decode(pending[:end] + b"]")
            except msgspec.ValidationError as exc:   # a genuine item of the wrong shape
                raise _json_error(self.path, exc) from None
            except msgspec.DecodeError as exc:
                closed = self._closed_before(pending, exc)
                if closed is not None:
                    return closed
                tries += 1
                if tries >= _MAX_CUT_TRIES:
                    break
                continue
            return events, pending[sep + 1:], pending[sep] == _CLOSE
        if not eof:
            return None, b"", False
        # the array's last item is not an object (or the array is empty): try each "]" from the end
        pos = len(pending)
        for _ in range(_MAX_END_TRIES):
            pos = pending.rfind(b"]", 0, pos)
            if pos < 0:
                break
            try:
                events = _EVENTS_DECODER.decode(pending[:pos + 1])
            except msgspec.ValidationError as exc:
                raise _json_error(self.path, exc) from None
            except msgspec.DecodeError:
                continue
            return events, pending[pos + 1:], True
        return None, b"", False

    def _closed_before(self, pending: bytes, exc: msgspec.DecodeError) -> tuple[list[Event], bytes, bool] | None:
        """When a candidate cut lay after the array's end (in the top-level members that follow it), the decoder
        reports trailing characters at the first byte after the array: decode up to there."""
        found = _TRAILING.search(str(exc))
        if found is None:
            return None
        close = pending.rfind(b"]", 0, int(found.group(1)))
        try:
            events = _EVENTS_DECODER.decode(pending[:close + 1])
        except msgspec.ValidationError as err:
            raise _json_error(self.path, err) from None
        except msgspec.DecodeError:
            return None
        return events, pending[close + 1:], True

    def _raise_unterminated(self, pending: bytes) -> None:
        """The file ended inside ``traceEvents``: the decoder's own message for the remaining text."""
        try:
            _EVENTS_DECODER.decode(pending)
        except msgspec.MsgspecError as exc:
            raise _json_error(self.path, exc) from None
        raise TraceError(f"{self.path}: invalid JSON: the 'traceEvents' array is not followed by the end of the "
                         f"top-level object. Re-record the trace, or remove the file from the folder.")


def _object_ends(text: bytes) -> Iterator[tuple[int, int]]:
    """From the end backwards: (index after a ``}``, index of the ``,`` or ``]`` after it and any whitespace)."""
    pos = len(text)
    size = len(text)
    while True:
        brace = text.rfind(b"}", 0, pos)
        if brace < 0:
            return
        sep = brace + 1
        while sep < size and text[sep] in _WHITESPACE:
            sep += 1
        if sep < size and (text[sep] == _COMMA or text[sep] == _CLOSE):
            yield brace + 1, sep
        pos = brace
