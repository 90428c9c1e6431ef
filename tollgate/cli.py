"""The ``tollgate`` command."""

from __future__ import annotations

import argparse
import asyncio
import runpy
import sys

from tollgate.catalog import load_catalog
from tollgate.settings import CommonSettings


def _run_service(module: str, argv: list[str]) -> int:
    # Services are started by module name: the library never imports them.
    sys.argv = [f"tollgate {module.rsplit('.', 1)[1]}", *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _up(ns: argparse.Namespace) -> int:
    from tollgate.supervisor import AlreadyRunning, Stack

    common = CommonSettings()
    catalog = load_catalog(common.catalog)
    models = ns.model or [next(iter(catalog.models))]
    for model in models:
        catalog.get(model)
    stack = Stack(common, host=ns.host, port=ns.port, nats_port=ns.nats_port, models=models)
    try:
        stack.acquire()
    except AlreadyRunning as exc:
        print(exc, file=sys.stderr)
        return 1
    return asyncio.run(stack.run(sys.stdout))


def _models(ns: argparse.Namespace) -> int:
    from tollgate.modelprep import ModelSourceError, prepare_model

    common = CommonSettings()
    catalog = load_catalog(common.catalog)
    if ns.action == "list":
        for entry in catalog.models.values():
            aliases = f" (aliases: {', '.join(entry.aliases)})" if entry.aliases else ""
            print(f"{entry.id}\t{entry.engine}\t{entry.source}{aliases}")
        return 0
    ids = ns.ids or list(catalog.models)
    for model_id in ids:
        try:
            path = prepare_model(catalog.get(model_id), common.model_cache_dir)
        except (KeyError, ModelSourceError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{model_id}: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("router", "worker"):
        return _run_service(f"services.{argv[0]}", argv[1:])
    parser = argparse.ArgumentParser(prog="tollgate", description="Tollgate LLM gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start NATS, the router and a worker on this machine")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8080)
    up.add_argument("--nats-port", type=int, default=4222)
    up.add_argument("--model", action="append", help="model to start a worker for (repeatable)")
    up.set_defaults(func=_up)
    models = sub.add_parser("models", help="the model catalog")
    models.add_argument("action", choices=["list", "prepare"])
    models.add_argument("ids", nargs="*")
    models.set_defaults(func=_models)
    sub.add_parser("router", help="run the router (python -m services.router)")
    sub.add_parser("worker", help="run a worker (python -m services.worker --model ID)")
    ns = parser.parse_args(argv)
    result: int = ns.func(ns)
    return result


if __name__ == "__main__":
    sys.exit(main())
