"""Builds and loads ``native_recorder.cpp``, the C++ recording backend of gloo groups read by ``pg_wrapper``.

    python -m dtprobe.collectors.native_recorder      # build it (scripts/install.sh does), or say why it cannot

The module is compiled once per (source, torch, Python) into a cache folder (``DTPROBE_NATIVE_CACHE``, else
``$XDG_CACHE_HOME/dtprobe/native``, else ``~/.cache/dtprobe/native``) and named by a hash of the three, so an
edited source or another torch never loads a stale build. ``load()`` only imports a finished build: a run never
compiles, and without a build (no compiler or headers at install, a changed source) ``pg_wrapper`` records in
Python, saying so once on stderr.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("native_recorder.cpp")
BUILD_COMMAND = "python -m dtprobe.collectors.native_recorder"
"""What builds it (the fallback message names it)."""


def cache_dir() -> Path:
    """The folder the builds are kept in."""
    if os.environ.get("DTPROBE_NATIVE_CACHE"):
        return Path(os.environ["DTPROBE_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dtprobe" / "native"


def module_name() -> str:
    """The extension's module name: a hash of the source, torch's version and Python's (its build's identity)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__}|{sys.version}|{sys.platform}".encode())
    return f"dtprobe_native_recorder_{digest.hexdigest()[:16]}"


def _built_path(name: str) -> Path:
    return cache_dir() / name / f"{name}.so"


def load() -> tuple[ModuleType | None, str]:
    """The built module and "", or None and why there is none (a sentence)."""
    try:
        name = module_name()
    except OSError as error:
        return None, f"its source is unreadable ({error})"
    path = _built_path(name)
    if not path.is_file():
        return None, f"it is not built for this source and torch {torch.__version__} (no {path})"
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as error:
        return None, f"its build {path} does not load ({error})"
    _name_dtypes(module)
    return module, ""


def _name_dtypes(module: ModuleType) -> None:
    """Give the module Python's name of every dtype (``str(dtype)`` without ``torch.``), as rows spell them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # experimental and deprecated dtypes say so when made
        for value in vars(torch).values():
            if isinstance(value, torch.dtype):
                try:
                    sample = torch.empty(0, dtype=value)
                except (RuntimeError, TypeError):
                    continue
                module.Recorder.set_dtype_name(sample, str(value).removeprefix("torch."))


def build(*, verbose: bool = False) -> tuple[ModuleType | None, str]:
    """Compile the module into the cache folder (nothing to do if it is there); the module and "", or None and why
    the build failed."""
    module, _ = load()
    if module is not None:
        return module, ""
    from torch.utils import cpp_extension

    name = module_name()
    folder = cache_dir() / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name, [str(SOURCE)], build_directory=str(folder), extra_cflags=["-O2"], verbose=verbose)
    except (OSError, RuntimeError, ImportError, SystemExit) as error:   # no compiler, no headers, no ninja
        return None, f"the build failed: {str(error).strip().splitlines()[-1] if str(error).strip() else error!r}"
    return load()


def main() -> int:
    """Build, and say where or why not; exits 0 either way (a missing build only means recording in Python)."""
    module, why = build(verbose="-v" in sys.argv[1:])
    if module is None:
        print(f"[native recorder] not built, collectives will be recorded in Python: {why}", file=sys.stderr)
    else:
        print(f"[native recorder] built: {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
