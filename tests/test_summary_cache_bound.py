"""The per-user summary cache stays bounded (``summary_store.prune_cache``): entries of folders that are gone go
first, then the least recently used, each with its kept results; the one just stored stays. And a stored summary's
key follows the code that made it (``summary_store.code_digest``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dtprobe import summary_store
from dtprobe.overview import Overview
from dtprobe.store.errors import ConfigError


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(summary_store.CACHE_ENV, str(tmp_path / "xdg"))
    monkeypatch.delenv(summary_store.CACHE_LIMIT_ENV, raising=False)
    return summary_store.cache_dir()


def _overview(path: Path) -> Overview:
    return Overview(path=str(path), whole=True, figures={}, num_steps=3, trends={}, findings=(), window=None,
                    made_s=0.0, clock_aligned="host", arrival_clock=None)


def _store(folder: Path, *, kept_bytes: int = 0, used_ns: int | None = None) -> Path:
    """A trace folder at ``folder`` with its summary stored in the cache (and ``kept_bytes`` of kept results beside
    it), last used at ``used_ns``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rank0.json").write_text("{}")
    stored = summary_store.store(folder, _overview(folder.resolve()), key={"k": folder.name})
    assert stored is not None and stored.parent == summary_store.cache_dir()
    if kept_bytes:
        kept = stored.with_suffix(".kept")
        kept.mkdir()
        (kept / "frame.parquet").write_bytes(b"x" * kept_bytes)
    if used_ns is not None:
        os.utime(stored, ns=(used_ns, used_ns))
    return stored


def test_the_least_recently_used_entries_go_until_the_rest_fit_with_their_kept_results(cache, tmp_path):
    old = _store(tmp_path / "old", kept_bytes=40_000, used_ns=1_000_000_000)
    mid = _store(tmp_path / "mid", kept_bytes=40_000, used_ns=2_000_000_000)
    new = _store(tmp_path / "new", kept_bytes=40_000, used_ns=3_000_000_000)
    entry_bytes = new.stat().st_size + 40_000

    removed = summary_store.prune_cache(max_bytes=2 * entry_bytes + 100)
    assert removed == [old]
    assert not old.exists() and not old.with_suffix(".kept").exists()
    assert mid.exists() and new.with_suffix(".kept").is_dir()

    assert summary_store.prune_cache(max_bytes=0, keep=mid) == [new]   # what was just stored stays
    assert sorted(p.name for p in cache.iterdir()) == sorted([mid.name, mid.with_suffix(".kept").name])


def test_a_summary_read_counts_as_a_use(cache, tmp_path):
    first = _store(tmp_path / "first", used_ns=1_000_000_000)
    second = _store(tmp_path / "second", used_ns=2_000_000_000)
    assert summary_store.load(tmp_path / "first", key={"k": "first"}) is not None      # first is now the newer
    assert summary_store.prune_cache(max_bytes=first.stat().st_size) == [second]
    assert first.exists()


def test_entries_of_gone_folders_and_orphaned_kept_results_go_whatever_the_room(cache, tmp_path):
    gone = _store(tmp_path / "gone", kept_bytes=10)
    here = _store(tmp_path / "here")
    shutil.rmtree(tmp_path / "gone")
    orphan = cache / ("0" * 32 + ".kept")
    orphan.mkdir()
    (cache / "not-ours.json").write_text("{}")          # not an entry's name: left alone
    damaged = cache / ("f" * 32 + ".json")
    damaged.write_text("{ torn")

    assert sorted(summary_store.prune_cache(max_bytes=10 << 20)) == sorted([gone, damaged])
    assert not gone.with_suffix(".kept").exists() and not orphan.exists()
    assert here.exists() and (cache / "not-ours.json").exists()


def test_storing_in_the_cache_prunes_it_to_the_bound_the_variable_sets(cache, tmp_path, monkeypatch):
    monkeypatch.setenv(summary_store.CACHE_LIMIT_ENV, "0")
    first = _store(tmp_path / "a")
    second = _store(tmp_path / "b")           # stored at a bound of 0 MB: only itself stays
    assert not first.exists() and second.exists()


def test_a_run_folders_own_summary_is_never_pruned(cache, tmp_path, monkeypatch):
    monkeypatch.setenv(summary_store.CACHE_LIMIT_ENV, "0")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"status": "completed"}')
    stored = summary_store.store(run, _overview(run.resolve()), key={"k": 1}, in_run_dir=True)
    assert stored == run.resolve() / summary_store.SUMMARY_FILE
    _store(tmp_path / "trace")
    assert stored.exists()


@pytest.mark.parametrize("value", ["lots", "-1", "1.5"])
def test_a_bound_that_is_not_whole_megabytes_is_an_error_naming_the_variable(cache, monkeypatch, value):
    monkeypatch.setenv(summary_store.CACHE_LIMIT_ENV, value)
    with pytest.raises(ConfigError, match=f"{summary_store.CACHE_LIMIT_ENV}=.*whole MB"):
        summary_store.cache_limit_bytes()


def test_the_code_digest_of_stored_summaries_follows_the_analysis_the_store_and_the_overview_only(tmp_path):
    package = Path(summary_store.__file__).resolve().parent
    root = tmp_path / "dtprobe"
    for part in ("analysis", "store"):
        shutil.copytree(package / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(package / "overview.py", root / "overview.py")
    (root / "cli.py").write_text("# not read by a summary\n")
    first = summary_store.code_digest(root)
    assert first == summary_store.analysis_code()                  # the copy is the installed code
    (root / "cli.py").write_text("# changed\n")
    assert summary_store.code_digest(root) == first
    for changed in ("analysis/stragglers.py", "store/reader.py", "overview.py"):
        path = root / changed
        before = path.read_bytes()
        path.write_bytes(before + b"\n# changed\n")
        assert summary_store.code_digest(root) != first, changed    # a summary it made is stale
        path.write_bytes(before)
    assert summary_store.code_digest(root) == first
