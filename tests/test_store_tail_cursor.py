"""``jsonl.tail_cursor``: where a tail-opened store starts reading a rank's events file, found by bisection, is
where a scan of every line from the end would put it."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from dtprobe.store import jsonl
from dtprobe.store.jsonl import FileCursor, tail_cursor


def _reference(path: Path, first_step: int) -> tuple[FileCursor, int]:
    """Every complete line read: the cursor after the last one whose step is in [0, first_step) (the lines before
    it its uncounted head), and how many lines that is."""
    data = path.read_bytes()
    data = data[: data.rfind(b"\n") + 1]
    found, offset = (FileCursor(), 0), 0
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        offset += len(line)
        m = re.search(rb'"step":\s*(-?\d+)', line)
        if m is not None and 0 <= int(m.group(1)) < first_step:
            found = (FileCursor(offset_bytes=offset, head_bytes=offset), number)
    return found


def _write(path: Path, steps: list[int | None], seed: int, torn: bool) -> None:
    rng = random.Random(seed)
    lines = []
    for s in steps:
        pad = "x" * rng.randrange(0, 120)              # lines of uneven length: probes land mid-line
        if s is None:
            lines.append(rng.choice(['{"step": null, "pad": "%s"}', '{"kind": "sample", "pad": "%s"}']) % pad)
        else:
            lines.append('{"op": "all_reduce", "step": %d, "pad": "%s"}' % (s, pad))
    text = "\n".join(lines) + "\n" + ('{"step": 99999, "op": "all_re' if torn else "")
    path.write_text(text)


def _lagging_steps(num_steps: int, per_step: int, seed: int) -> list[int | None]:
    """Rows of steps 0.., each written up to 2 steps late (never after a row 3 steps newer), with rows outside
    steps (-1, null, no key) among them."""
    rng = random.Random(seed)
    rows = [(s + rng.uniform(0, 2.99) if rng.random() < 0.2 else s + rng.uniform(0, 0.99), s)
            for s in range(num_steps) for _ in range(per_step)]
    rows += [(rng.uniform(0, num_steps), rng.choice([-1, None])) for _ in range(num_steps // 3)]
    return [s for _, s in sorted(rows, key=lambda r: r[0])]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("torn", [False, True])
def test_the_bisected_tail_cursor_is_where_a_scan_of_every_line_puts_it(tmp_path, monkeypatch, seed, torn):
    monkeypatch.setattr(jsonl, "_PROBE_BYTES", 300)      # many probes over a small file
    monkeypatch.setattr(jsonl, "_SCAN_BYTES", 700)
    path = tmp_path / "rank00000.jsonl"
    _write(path, _lagging_steps(120, 4, seed), seed, torn)
    for first_step in range(0, 125):
        cursor, lines = _reference(path, first_step)
        assert tail_cursor(path, first_step) == cursor, first_step
        assert tail_cursor(path, first_step).line_count(path) == lines, first_step


def test_a_file_that_starts_in_the_tail_or_ends_before_it(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "_PROBE_BYTES", 300)
    path = tmp_path / "rank00000.jsonl"
    _write(path, [None, None] + [s for s in range(40, 60) for _ in range(3)], 0, torn=True)
    assert tail_cursor(path, 40) == FileCursor()                 # nothing older than the tail: read it all
    assert tail_cursor(path, 45) == _reference(path, 45)[0] != FileCursor()
    last, lines = _reference(path, 1000)
    assert tail_cursor(path, 1000) == last and last.offset_bytes == path.read_bytes().rfind(b"\n") + 1
    assert tail_cursor(path, 1000).line_count(path) == lines == 62
    _write(path, [None, -1, None], 0, torn=False)                 # no step at all
    assert tail_cursor(path, 5) == FileCursor()


def test_a_restarted_rank_s_steps_going_back_move_the_cursor_no_later_than_a_scan_from_the_end(
        tmp_path, monkeypatch):
    # a run resumed from its step-25 checkpoint after a crash at step 30 writes steps 25.. again in the same file,
    # more than the slack behind: the bisection may stop at either attempt's steps, so the cursor may fall before
    # the one a scan from the end finds (the tail then holds more rows), never after it
    monkeypatch.setattr(jsonl, "_PROBE_BYTES", 300)
    monkeypatch.setattr(jsonl, "_SCAN_BYTES", 700)
    path = tmp_path / "rank00000.jsonl"
    _write(path, [s for s in list(range(31)) + list(range(25, 70)) for _ in range(3)], 1, torn=False)
    data = path.read_bytes()
    for first_step in range(0, 72):
        cursor = tail_cursor(path, first_step)
        assert cursor.offset_bytes <= _reference(path, first_step)[0].offset_bytes, first_step
        assert cursor.line_count(path) == data[:cursor.offset_bytes].count(b"\n")
        assert cursor.offset_bytes == 0 or data[cursor.offset_bytes - 1:cursor.offset_bytes] == b"\n"


def test_the_tail_open_reads_no_byte_of_the_head_it_skips_until_an_error_names_a_line_after_it(tmp_path, monkeypatch):
    # the head's newlines are counted only for a line number: a damaged line in the tail is named by the file's own
    # line number, as a whole read names it
    path = tmp_path / "rank00000.jsonl"
    _write(path, [s for s in range(60) for _ in range(3)], 0, torn=False)
    counted = []
    count_lines = jsonl._count_lines
    monkeypatch.setattr(jsonl, "_count_lines", lambda f, offset: counted.append(offset) or count_lines(f, offset))
    cursor = tail_cursor(path, 50)
    assert cursor.head_bytes == cursor.offset_bytes > 0 and counted == []
    assert jsonl.read_new_rows(path, cursor, "collectives", 0).num_rows == 30 and counted == []
    assert cursor.line_count(path) == 180 and counted == [cursor.head_bytes]
    with path.open("ab") as f:                            # a damaged line after the tail's rows: line 182
        f.write(b'{"op": "all_reduce", "step": 60}\n{"op": "all_reduce", "step": oops}\n')
    tail = tail_cursor(path, 50)
    with pytest.raises(jsonl.TraceError, match=r"line 182 is not valid JSON"):
        jsonl.read_new_rows(path, tail, "collectives", 0)
    with pytest.raises(jsonl.TraceError, match=r"line 182 is not valid JSON"):
        jsonl.read_new_rows(path, FileCursor(), "collectives", 0)
    assert tail == tail_cursor(path, 50)                  # left where it was
