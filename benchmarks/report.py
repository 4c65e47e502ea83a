"""How a bench reports (`rlboost bench NAME`): its figures as text while it runs (tables by
`print_table`), then its whole result as one JSON line on stdout, the last line it prints (tests,
docs and scripts parse that line; the log goes to stderr). `--out DIR` (`add_out`) also keeps
the result in `DIR/<bench>.json`, beside `DIR/<bench>.png` where the bench draws a plot."""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rlboost.logs import print_result

# A column of `print_table`: its title, the format spec of its values (">10,.0f", "<20", "+9.0%")
# and what it shows of a row: a key, or a function of the row.
Column = tuple[str, str, Any]


def add_out(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--out", default="", metavar="DIR",
                   help=what or "also write the result into DIR as <bench>.json (and <bench>.png where it plots)")


def out_dir(a: argparse.Namespace, prefix: str = "") -> Path | None:
    """`--out`, created. Without it: a new temp folder when the bench keeps files anyway (its
    runs' folders, worker logs: `prefix`), else None (nothing written)."""
    if not (a.out or prefix):
        return None
    d = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix=prefix))
    d.mkdir(parents=True, exist_ok=True)
    return d


def finish(bench: str, result: dict, out: Path | None = None, *, ok: bool = True,
           plot: Callable[[Path], None] | None = None, line: dict | None = None) -> int:
    """A bench's end: with a folder `out`, `<bench>.png` (`plot(path)`) and `<bench>.json` (the
    whole `result`); then the JSON line (`line`, a slimmer copy where the whole is too long for
    one line; default `result`). Returns the exit status: 0 if `ok`, else 1."""
    if out is not None:
        written = [f"{bench}.json"]
        if plot is not None:
            plot(out / f"{bench}.png")
            written.append(f"{bench}.png")
        (out / f"{bench}.json").write_text(json.dumps(result, indent=2))
        print(f"({' and '.join(written)} in {out})", flush=True)
    print_result(result if line is None else line)
    return 0 if ok else 1


_SPEC = re.compile(r"(?:.?([<>=^]))?[+\- ]?z?#?0?(\d*)")  # a format spec's alignment and width


def _cell(value: Any, spec: str) -> str:
    if value is None or value == "":  # nothing to show: blank, as wide as the column
        return " " * int(_SPEC.match(spec).group(2) or 0)  # type: ignore[union-attr]
    return format(value, spec)


def print_table(rows: Iterable[Any], columns: Sequence[Column], sep: str = " ") -> None:
    """A plain-text table: a header of the titles, then one line per row. A value that is None
    or missing (a key the row lacks) is a blank cell."""
    heads = []
    for title, spec, _ in columns:
        align, width = _SPEC.match(spec).groups()  # type: ignore[union-attr]
        heads.append(format(title, f"{'>' if align in ('>', '=') else align or '<'}{width}"))
    print(sep.join(heads).rstrip())
    for row in rows:
        cells = [_cell(get(row) if callable(get) else row.get(get), spec) for _, spec, get in columns]
        print(sep.join(cells).rstrip())
