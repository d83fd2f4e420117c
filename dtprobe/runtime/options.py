"""The options of ``dtprobe run``, derived from the job config dataclasses; read by ``commands.run`` and
``runtime.config``.

An option is a field of a config dataclass, written once: its name is the TOML key, its default gives the type
and the default, and the docstring under it is the help. A field marked with ``option(default, ...)`` also has a
command-line flag (``--batch-size`` for ``train.batch_size`` unless ``flag=`` names another); every field,
flagged or not, is a key of ``--config job.toml`` and of ``--set SECTION.KEY=VALUE``. Torch-free, so
``dtprobe run --help`` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, Mapping

LAUNCH_GROUP = "launch"
"""Flag group of the job's top-level keys (nproc, device, ...)."""


@dataclass(kw_only=True, frozen=True)
class Flag:
    """How a config field is spelled on the command line."""

    name: str = ""
    """The flag, e.g. ``--timeout``; empty: ``--`` + the field name with dashes (``--batch-size``)."""
    metavar: str = ""
    """Placeholder in the usage line; empty: the flag's name in capitals (``BATCH_SIZE``)."""
    choices: tuple[Any, ...] | None = None
    """Values argparse accepts (the dataclass validates the others)."""
    negate: bool = False
    """A ``--no-...`` switch that sets a bool field to false."""
    parse: Callable[[str], Any] | None = None
    """Turns the flag's text into the TOML value (``"10-11"`` -> ``[10, 11]``); errors are ConfigErrors."""
    fills_section: bool = False
    """``parse`` returns the whole section as a table (``--compress topk:ratio=0.01`` sets method and ratio)."""
    repeat: bool = False
    """The flag may be given several times; the TOML value is the list of them."""
    group: str = ""
    """Flag group in ``--help``; empty: the section's group."""


def option(default: Any, *, flag: str = "", toml: str = "", **spelling: Any) -> Any:
    """A dataclass field with a command-line flag (``flag``: its name if not derived from the field's; the other
    keywords are ``Flag``'s); ``toml`` renames its TOML key."""
    metadata: dict[str, Any] = {"flag": Flag(name=flag, **spelling)}
    if toml:
        metadata["toml"] = toml
    return field(default=default, metadata=metadata)


@dataclass(kw_only=True, frozen=True)
class SectionInfo:
    """Metadata of a section field of the job config (``[train]`` etc.)."""

    group: str
    """Flag group of its options in ``--help``."""
    flags: Mapping[str, Flag] = field(default_factory=dict)
    """Flags of fields whose dataclass is owned elsewhere (``CollectConfig`` is also ``dtprobe.attach``'s keyword
    set; how ``dtprobe run`` spells it belongs to the run command)."""


def section(cls: type, *, group: str, flags: Mapping[str, Flag] | None = None) -> Any:
    """A job config field holding the ``[name]`` table validated by the dataclass ``cls``."""
    return field(default_factory=cls, metadata={"section": SectionInfo(group=group, flags=dict(flags or {}))})


@dataclass(frozen=True)
class Option:
    """One key of the job config with everything derived from its field."""

    key: str
    """Dotted TOML key: ``train.steps``, or ``nproc`` at the top level."""
    spec: dataclasses.Field
    """The dataclass field."""
    doc: str
    """Its docstring, on one line."""
    flag: Flag | None
    """Its command-line spelling, or None for keys set with ``--config``/``--set`` only."""
    group: str
    """Flag group in ``--help``."""

    @property
    def default(self) -> Any:
        if self.spec.default is not dataclasses.MISSING:
            return self.spec.default
        return self.spec.default_factory()   # type: ignore[misc]

    @property
    def flag_name(self) -> str:
        assert self.flag is not None
        return self.flag.name or "--" + self.key.rpartition(".")[2].replace("_", "-")

    @property
    def help(self) -> str:
        """The docstring as ``--help`` shows it, with the default (flags leave unset keys to the file)."""
        doc = self.doc.replace("``", "")
        if self.flag is not None and self.flag.negate:
            return f"sets {self.key} = false. {doc}"
        default = self.default
        if default is None or default == () or self.flag is not None and self.flag.fills_section:
            return doc
        return f"{doc} (default {toml_value(default)})"


def sections(job_cls: type) -> dict[str, type]:
    """The job config's tables: name -> dataclass."""
    return {f.name: f.default_factory for f in dataclasses.fields(job_cls)   # type: ignore[misc]
            if "section" in f.metadata}


def top_level_keys(job_cls: type) -> dict[str, str]:
    """The job config's top-level (non-table) TOML keys -> field names."""
    return {f.metadata.get("toml", f.name): f.name for f in dataclasses.fields(job_cls) if "section" not in f.metadata}


def options(job_cls: type) -> list[Option]:
    """Every key of the job config, in field order (top-level keys, then each table's)."""
    return list(_iter_options(job_cls))


def _iter_options(job_cls: type) -> Iterator[Option]:
    job_docs = field_docs(job_cls)
    for f in dataclasses.fields(job_cls):
        info: SectionInfo | None = f.metadata.get("section")
        if info is None:
            flag = f.metadata.get("flag")
            yield Option(f.metadata.get("toml", f.name), f, job_docs.get(f.name, ""), flag,
                         (flag.group if flag and flag.group else LAUNCH_GROUP))
            continue
        cls = f.default_factory   # type: ignore[misc]
        docs = field_docs(cls)
        for sub in dataclasses.fields(cls):
            flag = sub.metadata.get("flag") or info.flags.get(sub.name)
            yield Option(f"{f.name}.{sub.name}", sub, docs.get(sub.name, ""), flag,
                         flag.group if flag and flag.group else info.group)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` (and of its dataclass bases), on one line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = _module_ast(inspect.getsourcefile(klass) or "")
        except (OSError, TypeError):   # no source shipped: options keep an empty help
            continue
        body = next((node.body for node in tree.body
                     if isinstance(node, ast.ClassDef) and node.name == klass.__name__), [])
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@functools.cache
def _module_ast(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def toml_value(value: Any) -> str:
    """``value`` written as in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)


# ------------------------------------------------------------------------------------------------ argparse

def add_flags(groups: Mapping[str, Any], job_cls: type, *, keys: Collection[str] | None = None) -> None:
    """One flag per flagged option of ``job_cls``, each in its argument group (``groups``: title -> the group
    ``parser.add_argument_group(title)`` returned); the usage line lists them group by group. ``keys``: only the
    options with these dotted keys (``dtprobe launch`` takes a subset of ``dtprobe run``'s flags)."""
    order = list(groups)
    chosen = [o for o in options(job_cls) if o.flag is not None and (keys is None or o.key in keys)]
    for opt in sorted(chosen, key=lambda o: order.index(o.group)):
        flag, kwargs = opt.flag, {"dest": opt.key, "help": opt.help}
        default = opt.default
        if flag.negate:
            kwargs.update(action="store_const", const=False, default=None)
        elif isinstance(default, bool):
            kwargs.update(action="store_true", default=None)
        else:
            kwargs.update(action="append" if flag.repeat else "store",
                          type=str if flag.parse or flag.repeat or default is None else type(default))
            if flag.choices is not None:
                kwargs["choices"] = flag.choices
            else:
                kwargs["metavar"] = flag.metavar or opt.flag_name.lstrip("-").upper().replace("-", "_")
        groups[opt.group].add_argument(opt.flag_name, **kwargs)


def flag_values(args: argparse.Namespace, job_cls: type) -> dict[str, Any]:
    """The job keys the flags set (flags not given are absent), as a nested dict shaped like job.toml."""
    out: dict[str, Any] = {}
    for opt in options(job_cls):
        value = getattr(args, opt.key, None) if opt.flag is not None else None
        if value is None:
            continue
        if opt.flag.parse is not None:   # type: ignore[union-attr]
            value = opt.flag.parse(value)   # type: ignore[union-attr]
        table, _, key = opt.key.rpartition(".")
        if not table:
            out[key] = value
        elif opt.flag.fills_section:   # type: ignore[union-attr]
            out.setdefault(table, {}).update(value)
        else:
            out.setdefault(table, {})[key] = value
    return out


def toml_reference(job_cls: type, *, width: int = 116) -> str:
    """Every key of job.toml with its default, one block per table (the ``--help`` epilog)."""
    lines: list[str] = []
    by_table: dict[str, list[str]] = {}
    for opt in options(job_cls):
        table, _, key = opt.key.rpartition(".")
        default = opt.default
        text = f"{key} = {toml_value(default)}" if default is not None else f"{key} (unset)"
        by_table.setdefault(table, []).append(text)
    by_table = {"": by_table.pop("", []), **by_table}   # top-level keys come before any table in TOML
    label_width = max(len(t) for t in by_table) + 4
    for table, items in by_table.items():
        rows: list[str] = []
        for item in items:   # greedy: a key and its value are never split
            if rows and len(rows[-1]) + 3 + len(item) <= width - label_width - 2:
                rows[-1] += "   " + item
            else:
                rows.append(item)
        label = f"[{table}]" if table else ""
        lines += [f"  {(label if i == 0 else ''):<{label_width}}{row}" for i, row in enumerate(rows)]
    return "\n".join(lines)
