"""The ``tollgate`` command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import logging
import runpy
import sys
import time
from collections.abc import Iterator
from datetime import date, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from nats.aio.client import Client as NATS

from tollgate.app import buscli
from tollgate.models.catalog import load_catalog
from tollgate.runtime.settings import CommonSettings, SettingError
from tollgate.wire.topology import Role

if TYPE_CHECKING:
    from tollgate.invoices import Invoice
    from tollgate.keys.records import KeyRecord, Limits

# How long a command waits for NATS before it gives up (a service waits for ever).
CONNECT_TIMEOUT_S = 10.0


class CliError(Exception):
    """A command that cannot do its work; the message is the one line shown."""


@contextlib.contextmanager
def _held_back(logger: logging.Logger) -> Iterator[list[str]]:
    """Collect the logger's messages instead of printing them."""
    said: list[str] = []

    class Hold(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            said.append(record.getMessage())
            return False

    hold = Hold()
    logger.addFilter(hold)
    try:
        yield said
    finally:
        logger.removeFilter(hold)


async def connect(common: CommonSettings, name: str) -> NATS:
    """The operator's connection, or one line saying why there is none.

    The retries of a first connect (one warning each) are held back: a
    command either connects or, after ``CONNECT_TIMEOUT_S``, says why not.
    """
    with _held_back(logging.getLogger("tollgate.wire.bus")) as said:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                return await common.connect(Role.ADMIN, name)
        except TimeoutError:
            # the hosts only: a URL may carry a user and password
            where = ", ".join(
                urlsplit(u.strip()).netloc.rpartition("@")[2] for u in common.nats_url.split(",")
            )
            why = f" (last: {said[-1]})" if said else ""
            raise CliError(
                f"NATS at {where} did not answer within {CONNECT_TIMEOUT_S:.0f} s{why}; "
                "is the stack running (`tollgate up`)?"
            ) from None


# Commands that run a service: its own module parses the rest of the line.
SERVICES = ("router", "worker", "auth", "metering", "scaler")


def _run_service(module: str, argv: list[str]) -> int:
    # Services are started by module name: the library never imports them.
    sys.argv = [f"tollgate {module.rsplit('.', 1)[1]}", *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _up(ns: argparse.Namespace) -> int:
    from tollgate.app.supervisor import AlreadyRunning, Stack

    common = CommonSettings()
    # The supervisor's own NATS client connects while nats-server is still
    # starting; its reconnect chatter is not for the operator's terminal.
    logging.getLogger("tollgate.wire.bus").setLevel(logging.ERROR)
    catalog = load_catalog(common.catalog)
    models = ns.model or [next(iter(catalog.models))]
    for model in models:
        catalog.get(model)
    stack = Stack(
        common,
        host=ns.host,
        port=ns.port or [8080],
        nats_port=ns.nats_port,
        auth_port=ns.auth_port,
        metering_port=ns.metering_port,
        scaler_port=ns.scaler_port,
        nats_monitor_port=ns.nats_monitor_port,
        models=models,
    )
    try:
        stack.acquire(sys.stdout)
    except AlreadyRunning as exc:
        print(exc, file=sys.stderr)
        return 1
    return asyncio.run(stack.run(sys.stdout))


def _models(ns: argparse.Namespace) -> int:
    from tollgate.app.modelcli import run_models

    return run_models(ns.action, ns.ids, fix=ns.fix)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "y": 365 * 86400}


def parse_ttl(text: str) -> float | None:
    """``30d``, ``12h``, ``90m``, ``3600s`` or ``never``."""
    if text == "never":
        return None
    number, unit = text[:-1], text[-1]
    if unit not in _UNITS or not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"ttl must look like 30d, 12h, 90m or never: {text!r}")
    return int(number) * _UNITS[unit]


def parse_budget(text: str) -> tuple[int, str]:
    """``1000000/month``, ``50000/day`` or ``1000000/total``."""
    amount, _, period = text.partition("/")
    if not amount.isdigit() or period not in ("day", "month", "total"):
        raise argparse.ArgumentTypeError(f"budget must look like 1000000/month: {text!r}")
    return int(amount), period


def parse_money_budget(text: str) -> tuple[str, str, str]:
    """``25/month``, ``25.50USD/month`` or ``1000EUR/total``: (amount, currency, period)."""
    import re

    found = re.fullmatch(r"(\d{1,12}(?:\.\d{1,9})?)([A-Z]{3})?/(day|month|total)", text)
    if found is None or not any(c in "123456789" for c in found[1]):
        raise argparse.ArgumentTypeError(
            f"a budget in money must look like 25.00USD/month (above zero): {text!r}"
        )
    return found[1], found[2] or "USD", found[3]


ALERTS_HELP = "spend alerts at these percentages of each budget: 80,95,100 (the default), none"


def parse_thresholds(text: str) -> list[int] | None:
    """``80,95,100`` (percent of each budget), ``none`` (no alerts) or ``default``."""
    if text == "default":
        return None
    if text == "none":
        return []
    parts = text.split(",")
    if not all(p.isdigit() and 1 <= int(p) <= 100 for p in parts) or len(parts) > 10:
        raise argparse.ArgumentTypeError(
            f"alerts must be up to 10 percentages from 1 to 100 (80,95,100), none or default: "
            f"{text!r}"
        )
    return sorted({int(p) for p in parts})


def parse_limit(text: str) -> int:
    """A whole number from 1 (a rate or a number of calls)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a limit is a whole number from 1: {text!r}")
    return int(text)


def parse_concurrency(text: str) -> int | None:
    """A number of calls at once (``8``), or ``none`` for no limit."""
    if text == "none":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"max-concurrent must be a whole number from 1, or none: {text!r}"
        )
    return int(text)


def parse_weight(text: str) -> float:
    """A key's share within its tenant: above 0, at most 1000 (``0.5``, ``1``, ``20``)."""
    try:
        weight = float(text)
    except ValueError:
        weight = float("nan")
    if not 0 < weight <= 1000:  # nan and inf fail here too
        raise argparse.ArgumentTypeError(
            f"weight must be a number above 0 and at most 1000: {text!r}"
        )
    return weight


def _limits(ns: argparse.Namespace) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    for name in ("rpm", "tpm", "name", "weight", "priority"):
        if getattr(ns, name, None) is not None:
            limits[name] = getattr(ns, name)
    # False: not given; None (`--max-concurrent none`): no limit
    if getattr(ns, "max_concurrent", False) is not False:
        limits["max_concurrent"] = ns.max_concurrent
    if getattr(ns, "priority_header", None):
        limits["priority_header"] = ns.priority_header == "on"
    if getattr(ns, "models", None):
        limits["models"] = [m.strip() for m in ns.models.split(",") if m.strip()]
    if getattr(ns, "budget_tokens", None):
        limits["budget_tokens"], limits["budget_period"] = ns.budget_tokens
    if getattr(ns, "budget_money", None):
        amount, currency, period = ns.budget_money
        if limits.get("budget_period", period) != period:
            raise SystemExit("error: --budget-tokens and --budget-money must name one period")
        limits["budget_amount"], limits["budget_currency"] = amount, currency
        limits["budget_period"] = period
    if getattr(ns, "alerts", False) is not False:
        limits["alert_thresholds"] = ns.alerts
    if getattr(ns, "capture", None):
        limits["capture"] = ns.capture == "on"
    return limits


async def _keys_async(ns: argparse.Namespace) -> int:
    import time

    from tollgate.keys.records import KeyState
    from tollgate.keys.store import KeyStore
    from tollgate.keys.tokens import SigningKeySet, auth_dir
    from tollgate.wire import bus

    common = CommonSettings()
    nc = await connect(common, "tollgate-cli")
    try:
        store = await KeyStore(
            nc.jetstream(), common.topology, actor=f"cli:{getpass.getuser()}"
        ).open()
        if ns.action == "create":
            signing = SigningKeySet(auth_dir(common.var_dir) / "signing-keys.json")
            if signing.current is None:
                print("error: no signing key here; start `tollgate up` first", file=sys.stderr)
                return 1
            limits = _limits(ns)
            if ns.replay:  # a replay identity: its X-Tollgate-Replay calls are not captured
                limits["replay"] = True
            token, record = await store.create(signing, tenant=ns.tenant, ttl_s=ns.ttl, **limits)
            # The key alone on stdout, so that `KEY=$(tollgate keys create ...)` holds it.
            print(f"key id: {record.key_id}\ntenant: {record.tenant}", file=sys.stderr)
            print("API key on stdout (shown once, store it now)", file=sys.stderr)
            print(token)
            return 0
        if ns.action == "list":
            for r in sorted(await store.all(), key=lambda r: r.created_at):
                print(
                    f"{r.key_id}  {r.tenant:<12} {r.state.value:<11} expires {_expiry(r)}  "
                    f"models {','.join(r.models)}  rpm {_cap(r.rpm)}  tpm {_cap(r.tpm)}  "
                    f"budget {_budget(r)}  "
                    f"concurrent {_cap(r.max_concurrent)}  weight {r.weight:g}  "
                    f"{_class(r)}  {r.name}"
                )
            return 0
        if ns.action == "show":
            found = await store.get(ns.key_id)
            if found is None:
                print(f"error: no key {ns.key_id!r}", file=sys.stderr)
                return 1
            print(_show(found))
            return 0
        if ns.action == "revoke":
            changed = await store.revoke(ns.key_id)
        else:
            update = _limits(ns)
            if ns.ttl is not False:
                update["expires_at"] = None if ns.ttl is None else time.time() + ns.ttl
            changed = await store.update(ns.key_id, lambda _: update)
        if changed is None:
            print(f"error: no key {ns.key_id!r}", file=sys.stderr)
            return 1
        if ns.action != "revoke" and changed.state is KeyState.REVOKED:
            print(
                f"error: key {ns.key_id!r} is revoked; a revoked key cannot be changed",
                file=sys.stderr,
            )
            return 1
        print(f"{'revoked' if ns.action == 'revoke' else 'updated'} {ns.key_id}")
        return 0
    finally:
        await bus.close(nc)


def _keys(ns: argparse.Namespace) -> int:
    return asyncio.run(_keys_async(ns))


async def _tenants_async(ns: argparse.Namespace) -> int:

    import orjson
    from nats.js.errors import KeyNotFoundError

    from tollgate.keys.records import TenantRecord, amount_text, budget_window, money_entry
    from tollgate.keys.tenants import TenantStore, tenant_scope
    from tollgate.wire import bus

    common = CommonSettings()
    nc = await connect(common, "tollgate-cli")
    try:
        js = nc.jetstream()
        store = await TenantStore(js, common.topology, actor=f"cli:{getpass.getuser()}").open()

        async def counted(entry: str) -> int:
            spend = await common.topology.bucket(js, common.topology.spend)
            try:
                found = await spend.get(entry)
            except KeyNotFoundError:
                return 0
            return int(orjson.loads(found.value or b"{}").get("tokens", 0))

        async def spent(record: TenantRecord) -> str:
            if record.budget_period is None:
                return "-"
            window = budget_window(record.budget_period, time.time())
            scope = tenant_scope(record.tenant)
            said = []
            if record.budget_tokens is not None:
                said.append(f"{await counted(f'{scope}.{window}')}/{record.budget_tokens}")
            if record.budget_amount is not None:
                currency = record.budget_currency
                nanos = await counted(money_entry(scope, window, currency))
                said.append(f"{amount_text(nanos)}/{record.budget_amount}{currency}")
            return " and ".join(said) or "-"

        if ns.action == "list":
            for r in await store.all():
                print(
                    f"{r.tenant:<16} rpm {_cap(r.rpm)}  tpm {_cap(r.tpm)}  "
                    f"concurrent {_cap(r.max_concurrent)}  "
                    f"budget {_budget(r)}  spent {await spent(r)}"
                    + ("  OVER BUDGET" if r.over_budget else "")
                )
            return 0
        if ns.action == "show":
            found = await store.get(ns.tenant)
            if found is None:
                print(f"error: tenant {ns.tenant!r} has no limits of its own", file=sys.stderr)
                return 1
            budget = _budget(found)
            lines = {
                "tenant": found.tenant,
                "rpm": found.rpm or "none",
                "tpm": found.tpm or "none",
                "max concurrent": found.max_concurrent or "none",
                "budget": budget,
                "alerts at": _alerts(found),
                "spent this period": await spent(found),
                "over budget": "yes" if found.over_budget else "no",
            }
            print("\n".join(f"{name:<18} {value}" for name, value in lines.items()))
            return 0
        if ns.action == "clear":
            if await store.clear(ns.tenant) is None:
                print(f"error: tenant {ns.tenant!r} has no limits of its own", file=sys.stderr)
                return 1
            print(f"cleared the limits of tenant {ns.tenant}")
            return 0
        limits = _limits(ns)
        record = await store.set_limits(ns.tenant, limits)
        print(
            f"set tenant {record.tenant}: rpm {_cap(record.rpm)}  tpm {_cap(record.tpm)}  "
            f"concurrent {_cap(record.max_concurrent)}  budget {_budget(record)}"
        )
        return 0
    finally:
        await bus.close(nc)


async def _webhooks_async(ns: argparse.Namespace) -> int:
    from tollgate.keys.webhooks import WebhookStore
    from tollgate.wire import bus

    common = CommonSettings()
    nc = await connect(common, "tollgate-cli")
    try:
        store = await WebhookStore(nc.jetstream(), common.topology).open()
        if ns.action == "add":
            if not ns.url.startswith(("http://", "https://")):
                print("error: a webhook URL is http:// or https://", file=sys.stderr)
                return 1
            record = await store.create(ns.url, ns.tenant)
            print(f"webhook id: {record.webhook_id}", file=sys.stderr)
            print("signing secret on stdout (shown once, store it now)", file=sys.stderr)
            print(record.secret)
            return 0
        if ns.action == "list":
            for r in await store.all():
                print(f"{r.webhook_id}  {r.tenant or '(every tenant)':<16} {r.url}")
            return 0
        if await store.delete(ns.webhook_id) is None:
            print(f"error: no webhook {ns.webhook_id!r}", file=sys.stderr)
            return 1
        print(f"removed {ns.webhook_id}")
        return 0
    finally:
        await bus.close(nc)


# The delivery log of spend alerts' webhooks, newest first (docs/analytics.md).
WEBHOOK_LOG_SQL = (
    "SELECT time, tenant, webhook_id, alert_id, attempt, outcome, http_status, error,"
    " round(seconds, 3) AS seconds, url"
    " FROM webhook_calls"
    " WHERE time >= now64(3) - toIntervalDay({days:UInt32})"
    " AND ({tenant:String} = '' OR tenant = {tenant:String})"
    " ORDER BY time DESC"
)


def _cap(value: int | None) -> str:
    """A limit as a list shows it: the number, or ``none``."""
    return "none" if value is None else str(value)


def _webhooks(ns: argparse.Namespace) -> int:
    if ns.action == "log":
        if ns.days < 1:
            print("error: --days must be 1 or more", file=sys.stderr)
            return 2
        parameters = {"days": ns.days, "tenant": ns.tenant or ""}
        return asyncio.run(_query_async(ns, WEBHOOK_LOG_SQL, parameters))
    return asyncio.run(_webhooks_async(ns))


def _alerts(record: Limits) -> str:
    """``80%, 95%, 100%`` of each budget, or ``none``."""
    return ", ".join(f"{pct}%" for pct in record.thresholds) or "none"


def _budget(record: Limits) -> str:
    """``1000000 tokens and 25.00 USD per month``, or ``none``."""
    amounts = []
    if record.budget_tokens is not None:
        amounts.append(f"{record.budget_tokens} tokens")
    if record.budget_amount is not None:
        amounts.append(f"{record.budget_amount} {record.budget_currency}")
    if not amounts or record.budget_period is None:
        return "none"
    return f"{' and '.join(amounts)} per {record.budget_period}"


def _tenants(ns: argparse.Namespace) -> int:
    return asyncio.run(_tenants_async(ns))


def _expiry(record: KeyRecord) -> str:
    if record.expires_at is None:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(record.expires_at))


def _class(record: KeyRecord) -> str:
    """``interactive``, ``batch``, or ``batch (header may raise)``."""
    if record.priority == "batch" and record.priority_header:
        return "batch (header may raise)"
    return str(record.priority)


def _show(record: KeyRecord) -> str:
    """One key's record, a setting a line (never a token: none is stored)."""

    def when(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))

    budget = (
        "none" if record.budget_tokens is None else f"{record.budget_tokens}/{record.budget_period}"
    )
    lines = {
        "key id": record.key_id,
        "tenant": record.tenant,
        "name": record.name,
        "state": record.state.value,
        "models": ",".join(record.models),
        "expires": _expiry(record),
        "rpm": "none" if record.rpm is None else str(record.rpm),
        "tpm": "none" if record.tpm is None else str(record.tpm),
        "budget": budget,
        "alerts at": _alerts(record),
        "money budget": "none"
        if record.budget_amount is None
        else f"{record.budget_amount}{record.budget_currency}/{record.budget_period}",
        "max concurrent": "none" if record.max_concurrent is None else str(record.max_concurrent),
        "weight": f"{record.weight:g}",
        "priority": str(record.priority),
        "priority header": "on" if record.priority_header else "off",
        "capture": "on" if record.capture else "off",
        "replay": "on" if record.replay else "off",
        "created": when(record.created_at),
        "updated": when(record.updated_at),
    }
    return "\n".join(f"{name + ':':<16} {value}" for name, value in lines.items())


async def _query_async(ns: argparse.Namespace, sql: str, parameters: dict[str, Any]) -> int:
    from tollgate.analytics import MeteringUnavailable, render, run_query
    from tollgate.wire import bus

    common = CommonSettings()
    nc = await connect(common, "tollgate-cli")
    try:
        result = await run_query(nc, common.subjects, sql, parameters, max_rows=ns.max_rows)
    except MeteringUnavailable as exc:
        print(f"error: {exc} (start it with `tollgate up` or `tollgate metering`)", file=sys.stderr)
        return 1
    finally:
        await bus.close(nc)
    if result.error is not None:
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    print(render(result, ns.format))
    if result.truncated:
        print(f"(only the first {len(result.rows)} rows are shown)", file=sys.stderr)
    return 0


def _usage(ns: argparse.Namespace) -> int:
    from tollgate.analytics import report_parameters, report_sql

    if ns.end <= ns.start:
        print("error: --to must be after --from", file=sys.stderr)
        return 2
    parameters = report_parameters(ns.tenant, ns.start, ns.end)
    return asyncio.run(_query_async(ns, report_sql(ns.by), parameters))


def _invoice(ns: argparse.Namespace) -> int:
    from pathlib import Path

    import orjson

    computed = asyncio.run(_invoice_async(ns))
    if isinstance(computed, int):
        return computed
    invoice, differences = computed
    if ns.format == "csv":
        text = invoice.to_csv()
    else:
        text = orjson.dumps(invoice.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n"
    if ns.out:
        Path(ns.out).write_text(text)
    else:
        sys.stdout.write(text)
    if invoice.unpriced:
        models = ", ".join(u.model for u in invoice.unpriced)
        print(f"warning: usage no price covers is not billed: {models}", file=sys.stderr)
    if not ns.check:
        return 0
    for difference in differences:
        print(f"difference: {difference}", file=sys.stderr)
    if differences:
        return 1
    agree = "checked: the raw rows, the hourly and daily rollups and usage_cost agree"
    print(agree, file=sys.stderr)
    return 0


async def _invoice_async(ns: argparse.Namespace) -> tuple[Invoice, list[str]] | int:
    """The invoice and, with ``--check``, its differences; or the exit code of a failure."""
    from tollgate.analytics import MeteringUnavailable, run_query
    from tollgate.invoices import InvoiceError, check, compute
    from tollgate.wire import bus
    from tollgate.wire.contracts import QueryResult

    common = CommonSettings()
    nc = await connect(common, "tollgate-cli")

    async def query(sql: str, parameters: dict[str, Any]) -> QueryResult:
        return await run_query(nc, common.subjects, sql, parameters, max_rows=100_000)

    try:
        if ns.check:
            report = await check(query, ns.tenant, ns.month)
            return report.invoice, report.differences
        return await compute(query, ns.tenant, ns.month), []
    except MeteringUnavailable as exc:
        print(f"error: {exc} (start it with `tollgate up` or `tollgate metering`)", file=sys.stderr)
        return 1
    except InvoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        await bus.close(nc)


def _sql(ns: argparse.Namespace) -> int:
    return asyncio.run(_query_async(ns, ns.statement, {}))


async def _scaler_status_async(as_json: bool) -> int:
    import orjson
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeoutError

    from tollgate.wire import bus

    common = CommonSettings()
    nc = await connect(common, "tollgate-cli")
    try:
        reply = await nc.request(common.subjects.scaler_status, b"{}", timeout=5)
    except (NoRespondersError, TimeoutError, NatsTimeoutError):
        print("error: no scaler answered (start it with `tollgate up`)", file=sys.stderr)
        return 1
    finally:
        await bus.close(nc)
    status = orjson.loads(reply.data)
    if as_json:
        print(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"backend: {status['backend']}")
    print(f"{'model':<32} desired ready starting draining queued running  min..max")
    for model, m in status["models"].items():
        print(
            f"{model:<32} {m['desired']:>7} {m['ready']:>5} {m['starting']:>8} "
            f"{m['draining']:>8} {m['queued']:>6} {m['running']:>7}  "
            f"{m['min_replicas']}..{m['max_replicas']}"
        )
    for model, m in status["models"].items():
        for d in m["decisions"][-5:]:
            when = time.strftime("%H:%M:%S", time.gmtime(d["time"]))
            print(f"  {when} {model}: {d['previous']} -> {d['desired']} ({d['reason']})")
    return 0


def _scaler_status(argv: list[str]) -> int:
    ns = scaler_status_parser().parse_args(argv)
    return asyncio.run(_scaler_status_async(ns.json))


async def _replay_async(ns: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from tollgate.analytics import MeteringUnavailable
    from tollgate.app.replay import ReplayError, replay
    from tollgate.keys.tokens import auth_dir
    from tollgate.wire import bus

    common = CommonSettings()
    api_key = ns.api_key or os.environ.get("TOLLGATE_API_KEY")
    demo = auth_dir(common.var_dir) / "demo-key"
    if not api_key and demo.exists():
        api_key = demo.read_text().strip()
    if not api_key:
        print("error: give --api-key (or TOLLGATE_API_KEY)", file=sys.stderr)
        return 2
    nc = await connect(common, "tollgate-replay")
    try:
        report = await replay(
            nc,
            common.subjects,
            base_url=ns.base_url,
            api_key=api_key,
            where=ns.where,
            model=ns.model,
            limit=ns.limit,
            concurrency=ns.concurrency,
        )
    except (ReplayError, MeteringUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        await bus.close(nc)
    out = Path(ns.out or f"replay-{report.replay_id}.md")
    markdown, details = report.write(out)
    print(report.markdown())
    print(f"report: {markdown} (every pair: {details}); rows in ClickHouse table `replays`")
    return 0 if report.pairs else 1


def _replay(ns: argparse.Namespace) -> int:
    return asyncio.run(_replay_async(ns))


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date like 2026-11-01: {text!r}") from None


def _month(text: str) -> Any:
    from tollgate.invoices import Period

    try:
        return Period.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class HelpFormatter(argparse.HelpFormatter):
    """Keeps each subcommand's summary on its name's line.

    argparse (3.11) measures subcommand names without the indent they are
    listed with, so a long name pushed its summary onto a line of its own.
    """

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.help is argparse.SUPPRESS:
            return
        for subaction in self._iter_indented_subactions(action):
            width = len(self._format_action_invocation(subaction)) + self._current_indent
            self._action_max_length = max(self._action_max_length, width)


def command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is its entry in the parent's list and its --help."""
    return sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)


def scaler_status_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tollgate scaler status",
        formatter_class=HelpFormatter,
        description="each model's replicas and the scaler's last decisions",
    )
    parser.add_argument("--json", action="store_true", help="the scaler's answer as JSON")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The ``tollgate`` command tree (the services parse their own arguments)."""
    parser = argparse.ArgumentParser(
        prog="tollgate",
        formatter_class=HelpFormatter,
        description="Tollgate: self-hosted LLMs behind one OpenAI-compatible endpoint",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = command(sub, "up", "start the whole stack on this machine")
    up.add_argument("--host", default="127.0.0.1", help="the router's address")
    up.add_argument(
        "--port",
        type=int,
        action="append",
        help="a router's port (default 8080); repeat it to run one router per port",
    )
    up.add_argument("--nats-port", type=int, default=4222, help="nats-server's port")
    up.add_argument("--auth-port", type=int, default=8081, help="the auth service's port")
    up.add_argument("--metering-port", type=int, default=8082, help="the metering service's port")
    up.add_argument("--scaler-port", type=int, default=8083, help="the scaler's port")
    up.add_argument(
        "--nats-monitor-port",
        type=int,
        help="serve nats-server's monitoring endpoints (/varz, /jsz) on this loopback port",
    )
    up.add_argument(
        "--model", action="append", help="model to keep warm, at one worker or more (repeatable)"
    )
    up.set_defaults(func=_up)
    models = command(sub, "models", "list, prepare, verify and remove the catalog's models")
    models.add_argument(
        "action",
        choices=["list", "prepare", "pull", "rm", "verify"],
        help="list the catalog and cache; prepare/pull weights; rm from the cache; "
        "verify sizes and sha256",
    )
    models.add_argument("ids", nargs="*", help="catalog model ids (default: every model)")
    models.add_argument("--fix", action="store_true", help="verify: prepare corrupt entries again")
    models.set_defaults(func=_models)
    keys = command(sub, "keys", "issue, list, show, change and revoke API keys (the whitelist)")
    key_actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = command(key_actions, "create", "issue a key; the key alone goes to stdout, shown once")
    create.add_argument("--tenant", required=True, help="who is billed for the key's calls")
    create.add_argument("--ttl", type=parse_ttl, default=None, help="30d, 12h, ... or never")
    create.add_argument(
        "--replay",
        action="store_true",
        help="a replay identity for `tollgate replay`: its replayed calls are not captured again",
    )
    update = command(key_actions, "update", "change a key's models, limits, share or expiry")
    update.add_argument("key_id", help="the key's id (from `keys list`)")
    update.add_argument("--ttl", type=parse_ttl, default=False, help="30d, 12h, ... or never")
    for p in (create, update):
        p.add_argument("--name", help="a label for the key")
        p.add_argument("--models", help="comma-separated ids or globs, e.g. 'SmolLM2-*'")
        p.add_argument("--rpm", type=int, help="requests per minute")
        p.add_argument("--tpm", type=int, help="tokens per minute")
        p.add_argument("--budget-tokens", type=parse_budget, help="e.g. 1000000/month")
        p.add_argument(
            "--budget-money",
            type=parse_money_budget,
            help="e.g. 25.00USD/month, at the catalog's prices (one period with --budget-tokens)",
        )
        p.add_argument(
            "--alerts", type=parse_thresholds, default=False, metavar="PCTS", help=ALERTS_HELP
        )
        p.add_argument(
            "--capture",
            choices=["on", "off"],
            help="keep this key's requests and responses in ClickHouse (exchanges)",
        )
        p.add_argument(
            "--max-concurrent",
            type=parse_concurrency,
            default=False,
            metavar="N",
            help="calls in flight at once, across every router (one more is a 429); none: no limit",
        )
        p.add_argument(
            "--weight",
            type=parse_weight,
            metavar="W",
            help="the key's share of a saturated model within its tenant (1 unless set)",
        )
        p.add_argument(
            "--priority",
            choices=["interactive", "batch"],
            help="the key's class: batch fills free capacity and yields to interactive",
        )
        p.add_argument(
            "--priority-header",
            choices=["on", "off"],
            help="whether a batch key's calls may raise themselves to interactive "
            "with X-Tollgate-Priority (any call may lower itself to batch)",
        )
    command(key_actions, "list", "every key, without tokens")
    show = command(key_actions, "show", "one key's record, a setting a line")
    show.add_argument("key_id", help="the key's id (from `keys list`)")
    revoke = command(key_actions, "revoke", "revoke a key at once")
    revoke.add_argument("key_id", help="the key's id (from `keys list`)")
    keys.set_defaults(func=_keys)
    tenants = command(sub, "tenants", "set, show, list and clear tenant-wide limits")
    tenant_actions = tenants.add_subparsers(dest="action", required=True, metavar="ACTION")
    tenant_set = command(tenant_actions, "set", "replace a tenant's limits over all its keys")
    tenant_set.add_argument("tenant", help="the tenant, as its keys name it")
    tenant_set.add_argument("--rpm", type=parse_limit, help="requests per minute, all keys")
    tenant_set.add_argument("--tpm", type=parse_limit, help="tokens per minute, all keys")
    tenant_set.add_argument(
        "--max-concurrent",
        type=parse_limit,
        metavar="N",
        help="calls in flight at once, all keys, across every router",
    )
    tenant_set.add_argument("--budget-tokens", type=parse_budget, help="e.g. 50000000/month")
    tenant_set.add_argument(
        "--budget-money", type=parse_money_budget, help="e.g. 500USD/month, all keys together"
    )
    tenant_set.add_argument(
        "--alerts", type=parse_thresholds, default=False, metavar="PCTS", help=ALERTS_HELP
    )
    command(tenant_actions, "list", "every tenant with limits of its own, with its spend")
    tenant_show = command(tenant_actions, "show", "one tenant's limits and spend, a line each")
    tenant_show.add_argument("tenant", help="the tenant, as its keys name it")
    tenant_clear = command(tenant_actions, "clear", "remove a tenant's own limits")
    tenant_clear.add_argument("tenant", help="the tenant, as its keys name it")
    tenants.set_defaults(func=_tenants)
    webhooks = command(sub, "webhooks", "add, list and remove the endpoints of spend alerts")
    hook_actions = webhooks.add_subparsers(dest="action", required=True, metavar="ACTION")
    hook_add = command(hook_actions, "add", "add an endpoint; its signing secret goes to stdout")
    hook_add.add_argument("url", help="where alerts are POSTed (http or https)")
    hook_add.add_argument("--tenant", help="only this tenant's alerts (default: every tenant's)")
    command(hook_actions, "list", "every endpoint, without secrets")
    hook_rm = command(hook_actions, "rm", "remove an endpoint")
    hook_rm.add_argument("webhook_id", help="the endpoint's id (from `webhooks list`)")
    hook_log = command(hook_actions, "log", "delivery attempts, newest first (ClickHouse)")
    hook_log.add_argument("--tenant", help="only this tenant's alerts (default: every tenant's)")
    hook_log.add_argument(
        "--days", type=int, default=7, help="attempts of the last DAYS days (default: 7)"
    )
    webhooks.set_defaults(func=_webhooks)
    usage = command(sub, "usage", "usage and cost, from the metering service")
    usage_actions = usage.add_subparsers(dest="action", required=True, metavar="ACTION")
    report = command(usage_actions, "report", "one tenant's usage and cost")
    report.add_argument("--tenant", required=True, help="the tenant to report on")
    first_of_month = date.today().replace(day=1)
    report.add_argument(
        "--from",
        dest="start",
        type=_day,
        default=first_of_month,
        help="first day (default: the first of this month)",
    )
    report.add_argument(
        "--to",
        dest="end",
        type=_day,
        default=date.today() + timedelta(days=1),
        help="the day after the last (default: tomorrow)",
    )
    report.add_argument(
        "--by", choices=["model", "key", "day"], default="model", help="one row per ..."
    )
    sql = command(sub, "sql", "a read-only ClickHouse query on the usage data")
    sql.add_argument("statement", help="one SELECT statement")
    for p in (report, sql, hook_log):
        p.add_argument(
            "--format", choices=["table", "csv", "json"], default="table", help="output format"
        )
        p.add_argument("--max-rows", type=int, default=10_000, help="at most this many rows")
    report.set_defaults(func=_usage)
    sql.set_defaults(func=_sql)
    inv = command(sub, "invoice", "a tenant's monthly invoice, from the usage rows")
    inv.add_argument("--tenant", required=True, help="the tenant to invoice")
    inv.add_argument("--month", required=True, type=_month, help="the month, e.g. 2026-11 (UTC)")
    inv.add_argument("--format", choices=["json", "csv"], default="json", help="output format")
    inv.add_argument("--out", help="write the invoice to this file (default: standard output)")
    inv.add_argument(
        "--check",
        action="store_true",
        help="recompute it from the rollup and usage_cost too; exit 1 on any difference",
    )
    inv.set_defaults(func=_invoice)
    rp = command(sub, "replay", "send captured requests to a model again and compare")
    rp.add_argument("--where", required=True, help="SQL condition on the exchanges table")
    rp.add_argument("--model", required=True, help="model to send them to")
    rp.add_argument("--limit", type=int, default=20, help="at most this many requests")
    rp.add_argument("--base-url", default="http://127.0.0.1:8080", help="the router")
    rp.add_argument("--api-key", help="key to call with (default: TOLLGATE_API_KEY, demo key)")
    rp.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    rp.add_argument("--out", help="report file (default replay-<id>.md; JSON beside it)")
    rp.set_defaults(func=_replay)
    buscli.add_parser(sub, command)
    # Run by module name before this parser is reached (see main); listed for --help.
    command(sub, "metering", "run the metering service; `metering migrate`: the schema")
    command(sub, "scaler", "run the scaler; see also `scaler status`, `scaler simulate`")
    command(sub, "router", "run the router, the OpenAI-compatible edge")
    command(sub, "auth", "run the auth service (admin API, budgets)")
    command(sub, "worker", "run a worker serving one model (--model ID)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["scaler", "status"]:
        return _scaler_status(argv[2:])
    if argv and argv[0] in SERVICES:
        return _run_service(f"services.{argv[0]}", argv[1:])
    ns = build_parser().parse_args(argv)
    try:
        result: int = ns.func(ns)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except SettingError as exc:  # names the setting, never a secret
        print(f"error: {exc}", file=sys.stderr)
        return 78  # EX_CONFIG, as the services exit on a setting that cannot work
    return result


if __name__ == "__main__":
    sys.exit(main())
