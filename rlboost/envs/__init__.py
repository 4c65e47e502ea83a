"""Environments: what an episode plays in (docs/concepts/environments.md). The episode runner
that calls them is `rlboost.episodes`.

- `protocol`: the environment protocol and its messages (`Env`, `Opening`, `ToolResult`, ...);
  its settings are `rlboost.config.EnvSettings` ([env]), a section of the one settings tree;
- `chat`: the tool-call format (the model's own chat template, or a documented fallback) and the
  parser of a model turn;
- `calculator`: a built-in multi-turn tool environment (arithmetic word problems);
- `adapters`: environments from libraries users already have (reasoning-gym, textarena,
  gymnasium); `verifiers_env` and `openenv_env`: verifiers and OpenEnv environments
  (`verifiers:...`, `openenv:...`).

`load_env(ref)` loads an environment the way `--env` names it: `module:fn`, `path/to/file.py:fn`,
a built-in name, or `SCHEME:TARGET` for an environment of another library (`verifiers:...`,
`openenv:...`), which that scheme's loader turns into an rlboost environment.
"""

from __future__ import annotations

from typing import Any

from rlboost import plugins
from rlboost.envs.protocol import EnvError, Environment

BUILTIN_ENVS = {
    "calculator": "rlboost.envs.calculator:make",
    "reasoning-gym": "rlboost.envs.adapters:reasoning_gym",
    "textarena": "rlboost.envs.adapters:textarena",
    "gymnasium": "rlboost.envs.adapters:gymnasium",
}

# `--env SCHEME:TARGET`: another library's environment, loaded by `fn(TARGET, **options)`. A scheme
# is checked before `module:fn` (a module named `verifiers` would otherwise be imported and asked
# for a function named TARGET).
SCHEMES: dict[str, str] = {
    "verifiers": "rlboost.envs.verifiers_env:load",
    "openenv": "rlboost.envs.openenv_env:load",
}


def load_env(ref: str, **options: Any) -> Environment:
    """The environment `ref` names: `module:fn`, `path/to/file.py:fn` or a built-in name; `fn`
    (a function or a class) is called with `options` (`[env.options]`) and must return an
    environment. `SCHEME:TARGET` (SCHEMES) calls the scheme's loader with TARGET and `options`."""
    scheme, sep, target = ref.partition(":")
    if sep and scheme in SCHEMES:
        if not target:
            raise EnvError(f"env {ref!r}: name the {scheme} environment after the colon ({scheme}:NAME)")
        loader = plugins.load(SCHEMES[scheme], what="env", error=EnvError)
        return _checked(ref, _made(ref, lambda: loader(target, **options)))
    factory = plugins.load(ref, what="env", builtins=BUILTIN_ENVS, error=EnvError)
    return _checked(ref, _made(ref, lambda: factory(**options)))


def _made(ref: str, make) -> Any:
    try:
        return make()
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"env {ref!r}: {plugins.resolve(ref, BUILTIN_ENVS)}() failed ({e!r})") from None


def _checked(ref: str, env: Any) -> Environment:
    missing = [m for m in ("start", "call_tool", "respond", "score") if not callable(getattr(env, m, None))]
    if missing:
        raise EnvError(f"env {ref!r}: {type(env).__name__} is not an environment (no {', '.join(missing)}); "
                       "subclass rlboost.envs.protocol.Env or write start/call_tool/respond/score")
    return env
