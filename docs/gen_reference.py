"""The generated parts of the docs: the CLI, the settings, the wire schema and the Prometheus metrics.

A MkDocs hook (`hooks:` in mkdocs.yml), so every `mkdocs build` writes them from the code as it
is: a page holds a marker such as `<!-- rlboost:generate cli -->` and the build replaces it with
the tables below. Nothing generated is committed, so a renamed flag or key changes the page.
The hand-written pages and the README name flags too (`rlboost run --resume RUN_DIR`): every
`rlboost COMMAND --flag` there is checked against that command's parser, and every
`--section.key` against the settings, so a renamed flag fails the build.

Sources:

- CLI: `rlboost.cli.build_parser()` for the top level; every delegated command
  (`rlboost.cli.COMMANDS`) and every benchmark builds its own parser inside its `main`. They are
  read by calling that `main` with `argparse.ArgumentParser.parse_args` / `parse_known_args`
  patched to hand back the parser instead of parsing: nothing runs past the parser, and the
  command modules need no change to be documented.
- Settings: the msgspec Structs of `rlboost/config.py`, with each key's comment from the source.
- Wire: the Structs and stream specs of the `rlboost/wire/` package.
- Metrics: the metric objects of `rlboost/metrics.py`.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # document this checkout's code, not an installed copy
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"<!--\s*rlboost:generate\s+([a-z_-]+)\s*-->")


# ---------------------------------------------------------------- CLI


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def _capture(fn: Callable[[], Any]) -> argparse.ArgumentParser | None:
    """The first parser `fn` asks to parse (None if it never does). A command that would start
    an event loop or a process before parsing anything is stopped there: a docs build runs no
    benchmark."""
    import asyncio
    import subprocess

    def grab(self, *args, **kwargs):
        raise _Captured(self)

    def refuse(*args, **kwargs):
        for a in args:
            if asyncio.iscoroutine(a):
                a.close()  # never awaited, by design: no warning for it
        raise RuntimeError("the command got past where its parser should be without parsing")

    saved = (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, asyncio.run,
             subprocess.Popen)
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = grab  # type: ignore[method-assign]
    asyncio.run = subprocess.Popen = refuse  # type: ignore[assignment, misc]
    try:
        fn()
    except _Captured as c:
        return c.parser
    finally:
        (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, asyncio.run,
         subprocess.Popen) = saved  # type: ignore[method-assign, misc]
    return None


def _main_parser(module: str) -> argparse.ArgumentParser | None:
    """The parser of a `main(argv, settings)` entry point; None for a module whose `main`
    has another shape (an internal process such as the fleet host: never called)."""
    from rlboost.config import Settings

    main = importlib.import_module(module).main
    params = [p for p in inspect.signature(main).parameters.values() if p.default is p.empty]
    if len(params) != 2:
        return None
    return _capture(lambda: main([], Settings()))


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """`rlboost ...` command line -> its parser, in the order the reference lists them."""
    from rlboost import cli

    top = cli.build_parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    out: dict[str, argparse.ArgumentParser] = {"rlboost": top}
    for name, parser in subs.items():
        if name in cli.COMMANDS:
            found = _main_parser(cli.COMMANDS[name][0])
            if found is None:
                raise RuntimeError(f"rlboost {name}: {cli.COMMANDS[name][0]}.main parses no arguments")
            out[f"rlboost {name}"] = found
        else:
            out[f"rlboost {name}"] = parser
    for name, (package, _) in sorted(cli._benchmarks().items()):
        found = _main_parser(f"{package}.{name}")
        if found is not None:
            out[f"rlboost bench {name.replace('_', '-')}"] = found
    return out


def _flat(text: Any) -> str:
    """One line, fit for a table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _cell(text: Any) -> str:
    """Prose for a table cell: `<data_dir>` is text, not an HTML tag."""
    return _flat(text).replace("<", "&lt;")


def _code(text: Any) -> str:
    s = _flat(text)
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:  # argparse's own expansion (%(default)s, %(prog)s)
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = prog
        text = text % params
    return text


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "flag"
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return " \\| ".join(_code(c) for c in action.choices)
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    kind = getattr(action.type, "__name__", "") if action.type else ""
    kind = kind if kind in ("int", "float") else ""
    many = {"+": " ...", "*": " ...", argparse.REMAINDER: " ..."}.get(action.nargs, "")
    return _code(f"{metavar}{many}") + (f" ({kind})" if kind else "")


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0 or isinstance(action, argparse._HelpAction):
        return ""
    if d == "" or d == []:
        return '`""`' if d == "" else "`[]`"
    return _code(d)


def parser_markdown(title: str, p: argparse.ArgumentParser, keys: dict[str, str] | None = None) -> str:
    """One command's section. `keys`: option dest -> the settings key it is a shorthand for."""
    keys = keys or {}
    lines = [f"## `{title}`", ""]
    if p.description:
        lines += [p.description.strip(), ""]
    lines += ["```text", p.format_usage().strip(), "```", ""]
    for group in p._action_groups:
        for sub in (a for a in group._group_actions if isinstance(a, argparse._SubParsersAction)):
            lines += ["| command | what |", "|---|---|"]
            lines += [f"| `{title} {c.dest}` | {_cell(c.help or '')} |" for c in sub._choices_actions]
            lines.append("")
        actions = [a for a in group._group_actions if not isinstance(a, argparse._SubParsersAction)]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments", "positional arguments"):
            lines += [f"**{group.title}**", ""]
        lines += ["| argument | value | default | what |", "|---|---|---|---|"]
        for a in actions:
            name = ", ".join(f"`{o}`" for o in a.option_strings) if a.option_strings else f"`{a.dest}` (positional)"
            what = _cell(_help(a, p.prog))
            if a.dest in keys:
                what += f"{'; ' if what else ''}setting `{keys[a.dest]}`"
            lines.append(f"| {name} | {_value(a)} | {_default(a)} | {what} |")
        lines.append("")
    if p.epilog:
        lines += ["```text", p.epilog.strip(), "```", ""]
    return "\n".join(lines)


def cli_markdown() -> str:
    parsers = command_parsers()
    # `rlboost run` / `demo` flags are shorthands for settings keys (trainer/command.py FLAGS)
    keys = getattr(importlib.import_module("rlboost.trainer.command"), "FLAGS", {})
    return "\n".join(parser_markdown(title, p, keys if title in ("rlboost run", "rlboost demo") else None)
                     for title, p in parsers.items())


# ---------------------------------------------------------------- msgspec Structs with their comments


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class source: the comment on its line, comment lines above it,
    and the lines that continue a trailing comment cut by the line limit (lower-case lines under a
    long line, when the next field has a comment of its own: a block above a field with none is
    that field's)."""
    src = inspect.getsource(cls)
    lines = src.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    body = ast.parse(src).body[0].body  # type: ignore[attr-defined]
    out: dict[str, list[str]] = {}
    prev_name, prev_end, prev_wrapped = None, body[0].lineno - 1, False
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            prev_name, prev_end = None, node.end_lineno or node.lineno
            continue
        name = node.target.id
        block = [comments[n] for n in range(prev_end + 1, node.lineno) if n in comments
                 and lines[n - 1].lstrip().startswith("#")]
        trailing = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comments]
        if block and prev_name and prev_wrapped and block[0][:1].islower() and trailing:
            out[prev_name] += block
            block = []
        out[name] = block + trailing
        last = lines[(node.end_lineno or node.lineno) - 1]
        prev_name, prev_end, prev_wrapped = name, node.end_lineno or node.lineno, bool(trailing) and len(last) >= 88
    return {k: " ".join(v) for k, v in out.items()}


def _struct_fields(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type as written, default, comment) per field of a msgspec Struct."""
    import msgspec

    notes = _field_comments(cls)
    annotations = inspect.get_annotations(cls)
    out = []
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        kind = annotations.get(f.name, f.type)
        out.append((f.name, kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind)), default,
                    notes.get(f.name, "")))
    return out


def _shown(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    if isinstance(value, str):
        home = str(Path.home())
        value = value.replace(home, "~", 1) if value.startswith(home) else value
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None:
        return "unset"
    return _code(value)


# ---------------------------------------------------------------- settings


def settings_sections() -> list[tuple[str, type]]:
    """(dotted section, Struct) for every section of the settings tree, nested ones included;
    "" for the top-level keys."""
    import msgspec

    from rlboost.config import Settings

    out: list[tuple[str, type]] = [("", Settings)]

    def walk(prefix: str, cls: type) -> None:
        for f in msgspec.structs.fields(cls):
            if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
                path = f"{prefix}.{f.name}" if prefix else f.name
                out.append((path, f.type))
                walk(path, f.type)

    walk("", Settings)
    return out


def settings_map_keys() -> list[str]:
    """The keys whose value is a table of the user's (`env.options`): `env.options.game` sets one entry."""
    import typing

    import msgspec

    return [f"{section}.{f.name}" if section else f.name for section, cls in settings_sections()
            for f in msgspec.structs.fields(cls) if typing.get_origin(f.type) is dict or f.type is dict]


def _known_key(name: str, keys) -> bool:
    return name in keys or any(name.startswith(k + ".") for k in settings_map_keys())


def settings_keys() -> list[str]:
    """Every settable key, dotted (`trainer.lr`, `services.auth.tls_ca`, `log_json`)."""
    import msgspec

    keys = []
    for section, cls in settings_sections():
        for f in msgspec.structs.fields(cls):
            if not (isinstance(f.type, type) and issubclass(f.type, msgspec.Struct)):
                keys.append(f"{section}.{f.name}" if section else f.name)
    return keys


def settings_markdown() -> str:
    import msgspec

    lines: list[str] = []
    for section, cls in settings_sections():
        env = "RLBOOST_" + "__".join(section.upper().split(".")) + "__" if section else "RLBOOST_"
        lines += [f"## `[{section}]`" if section else "## Top-level keys", ""]
        doc = inspect.getdoc(cls) if cls.__doc__ else ""
        if doc and section:
            lines += [" ".join(doc.split()), ""]
        lines += [f"Environment: `{env}<KEY>`" + (" (e.g. `RLBOOST_LOG_LEVEL`)" if not section else ""), ""]
        lines += ["| key | type | default | what |", "|---|---|---|---|"]
        for name, kind, default, note in _struct_fields(cls):
            if isinstance(default, msgspec.Struct):
                continue  # a nested section: its own heading below
            key = f"{section}.{name}" if section else name
            lines.append(f"| `{key}` | {_code(kind)} | {_shown(default)} | {_cell(note)} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- wire


def wire_markdown() -> str:
    import msgspec

    from rlboost import wire

    lines = [f"Schema version: **{wire.SCHEMA_VERSION}** (`rlboost.wire.SCHEMA_VERSION`).", "",
             "### Streams", "", "| stream | subjects | retention | max age | duplicate window |",
             "|---|---|---|---|---|"]
    for s in wire.STREAMS:
        age = f"{s.max_age_s / 86400:g} days" if s.max_age_s else "forever"
        lines.append(f"| `{s.name}` | {', '.join(_code(x) for x in s.subjects)} | {s.retention} | {age} | "
                     f"{s.duplicate_window_s:g} s |")
    lines += ["", "### Key-value buckets and object store", "", "| name | constant |", "|---|---|"]
    for const in sorted(n for n in dir(wire) if n.startswith("BUCKET_")):
        lines.append(f"| `{getattr(wire, const)}` | `wire.{const}` |")
    lines.append("")
    structs = [obj for _, obj in inspect.getmembers(wire, inspect.isclass)
               if issubclass(obj, msgspec.Struct) and obj.__module__.startswith(wire.__name__ + ".") and not obj.__name__.startswith("_")]
    # in reading order: the package's files in the order its __init__ names them, then by line
    files = ["names", "messages", "codec"]
    structs.sort(key=lambda c: (files.index(c.__module__.rpartition(".")[2]), inspect.getsourcelines(c)[1]))
    for cls in structs:
        lines += [f"### `{cls.__name__}`", ""]
        if cls.__doc__:
            lines += [" ".join(inspect.getdoc(cls).split()), ""]
        config = cls.__struct_config__
        if config.array_like:
            lines += ["Encoded as an array (fields in this order).", ""]
        lines += ["| field | type | default | what |", "|---|---|---|---|"]
        for name, kind, default, note in _struct_fields(cls):
            lines.append(f"| `{name}` | {_code(kind)} | {_shown(default)} | {_cell(note)} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- metrics


def metrics_markdown() -> str:
    from prometheus_client.metrics import MetricWrapperBase

    from rlboost import metrics

    found = [m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)]
    lines = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for m in sorted(found, key=lambda m: m._name):
        name = m._name + ("_total" if m._type == "counter" else "")
        labels = ", ".join(f"`{x}`" for x in m._labelnames)
        lines.append(f"| `{name}` | {m._type} | {labels} | {_cell(m._documentation)} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- flags named in the prose

# `rlboost ...` as a command (also `~/venv/bin/rlboost`, `-m rlboost.cli`), not `rlboost/wire.py`
_INVOCATION = re.compile(r"(?<![\w.-])(?:[\w.~-]*/)?rlboost(?:\.cli)?(?=[ \t])([^`\n]*)")
_GLOBAL_WITH_VALUE = {"--config", "--data-dir"}
_SHELL_STOP = {"#", "&&", "||", ";", "|", "(=", "="}


def _options_of(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


def unknown_flags(text: str) -> list[str]:
    """Each `rlboost COMMAND --flag` in `text` (code blocks, inline code, prose) whose flag the
    command's parser does not have, or whose `--section.key` / `section.key=` is no setting:
    the docs name flags by hand, so a renamed flag must fail the build here."""
    parsers = _cached("parsers", command_parsers)
    keys = set(_cached("keys", settings_keys))
    bad = []
    for m in _INVOCATION.finditer(text.replace("\\\n", " ")):
        tokens = [t.strip("[](),'\"") for t in m.group(1).split()]
        i = 0
        while i < len(tokens) and tokens[i].startswith("-"):
            i += 2 if tokens[i] in _GLOBAL_WITH_VALUE else 1
        if i >= len(tokens):
            continue
        command = f"rlboost {tokens[i]}"
        i += 1
        if command == "rlboost bench" and i < len(tokens):
            command, i = f"rlboost bench {tokens[i]}", i + 1
        if command not in parsers:
            continue  # `rlboost COMMAND ...`, `rlboost run: error: ...`: not an invocation
        options = _options_of(parsers[command])
        for tok in tokens[i:]:
            if tok in _SHELL_STOP or tok.startswith("#"):
                break
            name = tok.split("=", 1)[0]
            if name.startswith("--") and "." in name and command in ("rlboost run", "rlboost demo"):
                ok = _known_key(name[2:].replace("-", "_"), keys)  # --trainer.lr 1e-5
            elif name.startswith("-"):
                ok = name in options
            elif "=" in tok and re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", name) and command in ("rlboost run", "rlboost demo"):
                ok = _known_key(name, keys)  # run.checkpoint_every=1
            else:
                continue
            if not ok:
                bad.append(f"{command} {name}  (in: {m.group(0).strip()[:100]})")
    return bad


# ---------------------------------------------------------------- the hook

GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_markdown,
    "settings": settings_markdown,
    "wire": wire_markdown,
    "metrics": metrics_markdown,
}
_cache: dict[str, Any] = {}


def _cached(name: str, make: Callable[[], Any]) -> Any:
    if name not in _cache:
        _cache[name] = make()
    return _cache[name]


def expand(markdown: str) -> str:
    """`markdown` with every generate marker replaced; an unknown marker is an error."""

    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated section {name!r}; known: {', '.join(GENERATORS)}")
        return _cached(f"page:{name}", GENERATORS[name])

    return MARKER.sub(one, markdown)


def _fail(where: str, what: str) -> None:
    from mkdocs.exceptions import PluginError

    raise PluginError(f"{where}: {what}")


def on_pre_build(config, **kwargs) -> None:
    _cache.clear()  # `mkdocs serve` rebuilds: regenerate from the code as it is now
    bad = unknown_flags((ROOT / "README.md").read_text())  # the README is no page, but names flags too
    if bad:
        _fail("README.md", "flags no parser has: " + "; ".join(bad))


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    bad = unknown_flags(markdown)  # the hand-written text only, before the generated parts go in
    if bad:
        _fail(page.file.src_uri, "flags no parser has: " + "; ".join(bad))
    try:
        return expand(markdown)
    except Exception as e:  # one line naming the page, and the build fails
        _fail(page.file.src_uri, f"generating the reference failed: {type(e).__name__}: {e}")
        raise


if __name__ == "__main__":  # print a generated section: python docs/gen_reference.py cli
    for arg in sys.argv[1:] or list(GENERATORS):
        print(GENERATORS[arg]())
