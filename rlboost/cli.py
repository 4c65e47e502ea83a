"""The `rlboost` command.

Subcommands that need the servers find them through the settings (external URLs) or the data
dir (embedded servers started by `rlboost up`). Benchmarks live one per module in
the top-level `benchmarks/` wing and are dispatched by name (imported by name, never by the
product's code), so adding one needs no change here.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import pkgutil
import re
import signal
import sys
import threading
import traceback

from rlboost.config import Settings, load_settings
from rlboost.errors import RlboostError
from rlboost.logs import configure_logging
from rlboost.services import EmbeddedServices


def _settings(args: argparse.Namespace) -> Settings:
    s = load_settings(args.config)
    if args.data_dir:
        s.services.data_dir = args.data_dir
    if args.log_json:
        s.log_json = True
    configure_logging(json=s.log_json, level=s.log_level)
    return s


def cmd_up(args: argparse.Namespace, s: Settings) -> int:
    if args.cluster:
        s.services.nats_cluster = args.cluster
    if args.sentinel:
        s.services.redis_sentinel = True
    if args.redis_cluster:
        s.services.redis_cluster = args.redis_cluster
    svc = EmbeddedServices(s.services)
    st, started = svc.up()
    if started and s.services.nats_cluster > 1:
        import asyncio

        from rlboost.services import provision_cluster

        replicas = asyncio.run(provision_cluster(svc.nats_url(st), min(3, s.services.nats_cluster)))
        print(f"JetStream cluster of {s.services.nats_cluster} nodes: streams, KV buckets and the weight "
              f"store at replication {replicas}")
    word = "started" if started else "already running"
    print(f"{word}: nats {svc.nats_url(st)} (JetStream in {svc.data_dir / 'jetstream'}), redis {svc.redis_url(st)}")
    print(f"state: {svc.state_path}")
    return 0


def cmd_down(args: argparse.Namespace, s: Settings) -> int:
    stopped = EmbeddedServices(s.services).stop_recorded()
    print(f"stopped {len(stopped)} server process(es)" + (f": pids {stopped}" if stopped else ""))
    return 0


def cmd_status(args: argparse.Namespace, s: Settings) -> int:
    from rlboost.status import show_status

    return show_status(s, as_json=args.json, watch=args.watch)


# The CLI is the composition root: it finds benchmarks and commands of every package by
# module name. The core modules of rlboost/ never import workers/ or trainer/, and no product
# module imports the benchmarks wing (tests/test_imports.py).
BENCH_PACKAGES = ("rlboost.benchmarks",)


def cmd_bench(args: argparse.Namespace, s: Settings) -> int:
    names = _bench_names()
    args.name = args.name.replace("-", "_")  # `bench train-memory` is the module train_memory
    if args.name not in names:
        print(f"unknown benchmark {args.name!r}; available: {', '.join(sorted(names))}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{names[args.name]}.{args.name}")
    return int(module.main(args.rest, s) or 0)


def _bench_names() -> dict[str, str]:
    """Benchmark name -> package, for every module of the bench packages that defines a
    top-level `main` (a helper module such as benchmarks.throughput is not a benchmark)."""
    return {name: package for name, (package, _) in _benchmarks().items()}


def _benchmarks() -> dict[str, tuple[str, str]]:
    """name -> (package, first docstring line). Read from the source with `ast`, not imported:
    `rlboost bench --help` must not pay for importing torch."""
    found: dict[str, tuple[str, str]] = {}
    for package in BENCH_PACKAGES:
        try:
            pkg = importlib.import_module(package)
        except ImportError:
            continue
        for m in pkgutil.iter_modules(pkg.__path__):
            if m.name.startswith("_") or m.name in found:
                continue
            spec = importlib.util.find_spec(f"{package}.{m.name}")
            try:
                with open(spec.origin, encoding="utf-8") as f:  # type: ignore[union-attr, arg-type]
                    tree = ast.parse(f.read())
            except (OSError, SyntaxError, TypeError, AttributeError):
                continue
            if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
                found[m.name] = (package, _summary(ast.get_docstring(tree) or ""))
    return found


def _summary(doc: str) -> str:
    """A bench module's one-line summary: its docstring's first sentence, without the
    "`rlboost bench NAME`: " it opens with."""
    para = " ".join(doc.strip().split("\n\n", 1)[0].split())
    para = para.split("`: ", 1)[-1]
    return re.split(r"(?<=[.?!])\s", para, maxsplit=1)[0]


def _bench_help() -> str:
    rows = sorted(_benchmarks().items())
    width = max((len(n) for n, _ in rows), default=0)
    return "benchmarks (`rlboost bench NAME --help` for a benchmark's options):\n" + "\n".join(
        f"  {name.replace('_', '-'):{width}}  {doc}" for name, (_, doc) in rows)


def _run_module(module: str):
    """A subcommand implemented as `main(argv, settings)` in another module (lazy import:
    `rlboost status` must not pay for importing torch)."""

    def run(args: argparse.Namespace, s: Settings) -> int:
        return int(importlib.import_module(module).main(args.rest, s) or 0)

    return run


COMMANDS = {
    "demo": ("rlboost.trainer.demo", "the main job: bootstrap the model, run hybrid RL with 2 preemptible workers"),
    "smoke": ("rlboost.smoke", "dataflow smoke: requests -> consumer -> checkpoints -> results"),
    "worker": ("rlboost.workers.main", "run a rollout worker: rlboost worker --pool NAME --engine ENGINE"),
    "env-worker": ("rlboost.workers.env_worker", "run an environment worker: episodes' tool calls off the GPUs (env.inline = false)"),
    "replay": ("rlboost.replay", "print the life of a request or a step from the streams"),
    "init-model": ("rlboost.trainer.bootstrap", "build and warm-start the small local model"),
    "run": ("rlboost.trainer.command", "run RL training with a rollout policy"),
    "serve-openai": ("rlboost.endpoint", "an OpenAI-compatible chat endpoint: each call a checkpointed request"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlboost", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="TOML settings file (default: $RLBOOST_CONFIG)")
    p.add_argument("--data-dir", help="state dir of the embedded servers (default: $RLBOOST_DATA_DIR)")
    p.add_argument("--log-json", action="store_true", help="JSON log lines instead of console lines")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error, not only its one line")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start embedded NATS (JetStream) and Redis on free loopback ports")
    up.add_argument("--cluster", type=int, default=0, help="N JetStream nodes (a cluster on loopback), replication 3")
    up.add_argument("--sentinel", action="store_true", help="Redis primary + replica + a sentinel (automatic failover)")
    up.add_argument("--redis-cluster", type=int, metavar="N",
                    help="a Redis Cluster of N masters (checkpoints sharded by request)")
    up.set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop the embedded servers started by `up`").set_defaults(fn=cmd_down)
    st = sub.add_parser("status", help="servers, streams, queue depths and live workers")
    st.add_argument("--json", action="store_true")
    st.add_argument("--watch", action="store_true", help="the fleet live (rich), until Ctrl-C")
    st.set_defaults(fn=cmd_status)
    b = sub.add_parser("bench", help="benchmarks; each ends with one JSON line", epilog=_bench_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("name", help="the benchmark (listed below)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    for name, (module, help_) in COMMANDS.items():
        c = sub.add_parser(name, help=help_, add_help=False)
        c.add_argument("rest", nargs=argparse.REMAINDER)
        c.set_defaults(fn=_run_module(module))
    return p


def _delegation_point(argv: list[str]) -> int:
    takes_value = {"--config", "--data-dir"}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in takes_value:
            i += 2
        elif tok.startswith("-"):
            i += 1
        elif tok in COMMANDS:
            return i + 1
        elif tok == "bench":
            return min(i + 2, len(argv))
        else:
            break
    return len(argv)


_terminated = False


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (a scheduler, Kubernetes, `timeout`) stops a command as Ctrl-C does, so its
    cleanup runs: `rlboost run` stops the servers and workers it started (the default action
    left its NATS and Redis servers running, orphaned). Raised as SIGINT, not as an exception
    here: inside `asyncio.run` SIGINT cancels the main task, whose `finally` blocks then run in
    the loop (where SIGINT is ignored, a background job of a script, the exception it is).
    Commands that serve (`worker`, `env-worker`, `endpoint`) install their own handlers in
    their loop, which replace this one."""
    global _terminated
    _terminated = True
    if not callable(signal.getsignal(signal.SIGINT)):  # SIGINT ignored (a background job of a script)
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # not where an embedding program (or a test calling main) set its own, and only where it can
    own = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread()
    if own:
        global _terminated
        _terminated = False
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(argv)
    finally:
        if own:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _main(argv: list[str]) -> int:
    # Everything after a delegated command (and a bench name) belongs to that command's own
    # parser: split it off before argparse sees option strings it does not know.
    cut = _delegation_point(argv)
    args = build_parser().parse_args(argv[:cut])
    if cut < len(argv):
        args.rest = argv[cut:]
    try:
        s = _settings(args)
        return args.fn(args, s)
    except (RlboostError, ConnectionError) as e:
        # a refusal made on purpose, with its reason: one line, exit 2 (every command's
        # user errors); the traceback too with --debug or --log-json (a log pipeline keeps it)
        if args.debug or args.log_json:
            traceback.print_exc()
        print(f"rlboost: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 143 if _terminated else 130  # 128 + the signal, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
