"""One loader for the functions a user names on the command line: `module:fn` (an importable
module) or `path/to/file.py:fn` (a file, imported under a private module name). Rewards
(`--reward`, trainer/rewards.py) and environments (`--env`, rlboost/envs) both load through it,
so both accept the same spellings and fail with the same one-line errors. A table of built-in
short names (`addition`, `calculator`) may stand for a full reference.

Loading imports user code: that is the point. What is imported is whatever the user named;
nothing is fetched and nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from rlboost.errors import RlboostError


class PluginError(RlboostError, ValueError):
    """A reference that does not name a usable object (one line, says why)."""


def resolve(spec: str, builtins: dict[str, str] | None = None) -> str:
    """`spec`, or the full reference a built-in short name stands for."""
    return (builtins or {}).get(spec, spec)


def is_file_ref(where: str) -> bool:
    return where.endswith(".py") or "/" in where


def load(spec: str, *, what: str = "plugin", builtins: dict[str, str] | None = None,
         error: type[Exception] = PluginError, callable_only: bool = True) -> Any:
    """The object `spec` names. `what` starts every error message (`reward 'x:y': ...`);
    `error` is the class raised (a subclass of RlboostError for callers that keep their own)."""
    spec = resolve(spec, builtins)
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise error(f"{what} {spec!r}: use module:function or path/to/file.py:function")
    if is_file_ref(where):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise error(f"{what} {spec!r}: no such file {path}")
        # a stable private name per file (hash() of a str changes between processes)
        module_name = f"rlboost_{what.replace(' ', '_')}_{hashlib.sha256(str(path).encode()).hexdigest()[:16]}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise error(f"{what} {spec!r}: {path} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(module_name, None)
            raise error(f"{what} {spec!r}: {path} failed to import ({e!r})") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise error(f"{what} {spec!r}: cannot import {where} ({e})") from None
        except Exception as e:  # the module itself raised while importing
            raise error(f"{what} {spec!r}: {where} failed to import ({e!r})") from None
    obj = getattr(module, name, None)
    if obj is None or (callable_only and not callable(obj)):
        raise error(f"{what} {spec!r}: {where} has no function {name!r}")
    return obj
