"""What an analyst's statement may touch, decided from ClickHouse's own parse of it.

``readonly`` alone leaves too much open: table functions (``file()``,
``url()``, ``s3()``, ``remote()``...) read and fetch with the rights of the
metering process, ``system.*`` is readable and a ``SETTINGS`` clause lifts
the query's own limits. Before a statement runs, ClickHouse parses it three
times for us, none of which executes anything the analyst wrote:

1. ``formatQuery()`` (the statement passed as a bound parameter): exactly one
   statement, or a syntax error;
2. ``EXPLAIN AST``: a ``SELECT`` (``WITH``, ``UNION`` and ``INTERSECT``
   included) with no ``SETTINGS``, ``FORMAT`` or ``INTO OUTFILE``, no table
   function outside a few generators, no table named in another database and
   no function that reads outside the database (``file``, dictionaries...),
   and no ``x IN db.table`` naming another database (step 3 would be too
   late for one in a constant subquery, which analysis evaluates);
3. ``EXPLAIN QUERY TREE`` (only once 2 passed, since analysis evaluates
   constant subqueries): every table the analyzer resolved, including
   ``x IN db.table``, is in Tollgate's database.

The checks read ClickHouse's tree dumps, never the SQL text. The statement
then runs on a read-only connection with the service's limits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Table functions that only generate values.
ALLOWED_TABLE_FUNCTIONS = frozenset(
    {"numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateseries", "values"}
)
# Ordinary functions that reach outside Tollgate's tables.
REFUSED_FUNCTIONS = frozenset(
    {"file", "catboostevaluate", "hascolumnintable", "joinget", "joingetornull", "getservers"}
)
# The operators whose right side may name a table (``x IN db.table``).
_IN_FUNCTIONS = frozenset(
    {
        "in",
        "notin",
        "globalin",
        "globalnotin",
        "nullin",
        "notnullin",
        "globalnullin",
        "globalnotnullin",
    }
)
# The one-row table a SELECT without FROM reads (the analyzer names it).
_DUMMY_TABLES = frozenset({"system.one"})
_DICTIONARY_PREFIX = "dict"  # dictGet*, dictHas, dictIsIn...: Tollgate defines no dictionary

FORMAT_HINT = (
    "A FORMAT clause is not accepted: the metering service returns rows, and "
    "`tollgate sql --format table|csv|json` chooses how they are printed."
)


class RefusedQuery(ValueError):
    """The statement is not one an analyst may run (the message says why)."""


@dataclass(frozen=True)
class _Node:
    depth: int
    kind: str
    rest: str


def _nodes(dump: str) -> list[_Node]:
    """EXPLAIN's tree, one node a line, its depth given by the indentation."""
    found = []
    # Lines end at "\n" only: a literal may hold a vertical tab, a form feed or a
    # Unicode line separator, which str.splitlines would take for line ends.
    for line in dump.split("\n"):
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip(" "))
        kind, _, rest = line.strip().partition(" ")
        found.append(_Node(depth, kind, rest))
    return found


def _field(rest: str, name: str) -> str | None:
    """A ``name: value`` field of a QUERY TREE node line."""
    for part in rest.split(", "):
        key, sep, value = part.partition(": ")
        if sep and key.strip() == name:
            return value.strip()
    return None


def _function_refused(name: str) -> bool:
    lowered = name.lower()
    return lowered in REFUSED_FUNCTIONS or lowered.startswith(_DICTIONARY_PREFIX)


def check_ast(dump: str, database: str) -> None:
    """Refuse what ``EXPLAIN AST`` shows an analyst may not run."""
    nodes = _nodes(dump)
    if not nodes:
        raise RefusedQuery("The statement is empty.")
    root = nodes[0]
    if root.kind != "SelectWithUnionQuery" or any(n.depth == root.depth for n in nodes[1:]):
        raise RefusedQuery(
            "Only a single SELECT statement (WITH, UNION and INTERSECT included) may run "
            f"here, not {root.kind}."
        )
    for parent, node in itertools.pairwise(nodes):
        if node.depth == root.depth + 1 and node.kind != "ExpressionList":
            if node.kind == "Identifier":
                raise RefusedQuery(FORMAT_HINT)
            if node.kind == "Literal":
                raise RefusedQuery("INTO OUTFILE is not accepted: nothing is written to files.")
        if node.kind == "Set":
            raise RefusedQuery(
                "A SETTINGS clause is not accepted: the query runs with the metering "
                "service's limits (time, rows, memory)."
            )
        if node.kind == "Function":
            name = node.rest.split(" ", 1)[0]
            if parent.kind == "TableExpression" and parent.depth == node.depth - 1:
                if name.lower() not in ALLOWED_TABLE_FUNCTIONS:
                    raise RefusedQuery(
                        f"The table function {name}() is not accepted: queries read "
                        f"Tollgate's tables in `{database}` only."
                    )
            elif _function_refused(name):
                raise RefusedQuery(
                    f"The function {name}() is not accepted: it reads outside Tollgate's tables."
                )
        if node.kind == "TableIdentifier":
            _check_table(node.rest.split(" ", 1)[0], database)
    for i, node in enumerate(nodes):
        if node.kind == "Function" and node.rest.split(" ", 1)[0].lower() in _IN_FUNCTIONS:
            right = _argument(nodes, i, 1)
            if right is not None and right.kind == "Identifier":
                _check_table(right.rest.split(" ", 1)[0], database)


def _argument(nodes: list[_Node], at: int, index: int) -> _Node | None:
    """Argument ``index`` of the function at ``nodes[at]`` (its ExpressionList's child)."""
    depth = nodes[at].depth + 2
    seen = -1
    for node in nodes[at + 1 :]:
        if node.depth < depth:
            if node.depth <= nodes[at].depth:
                break
            continue
        if node.depth == depth:
            seen += 1
            if seen == index:
                return node
    return None


def check_query_tree(dump: str, database: str) -> None:
    """Refuse what the analyzer resolved outside Tollgate's database."""
    for node in _nodes(dump):
        if node.kind == "TABLE":
            _check_table(_field(node.rest, "table_name") or "", database)
        elif node.kind == "TABLE_FUNCTION":
            name = _field(node.rest, "table_function_name") or "?"
            if name.lower() not in ALLOWED_TABLE_FUNCTIONS:
                raise RefusedQuery(
                    f"The table function {name}() is not accepted: queries read "
                    f"Tollgate's tables in `{database}` only."
                )
        elif node.kind == "FUNCTION":
            name = _field(node.rest, "function_name") or ""
            if _function_refused(name):
                raise RefusedQuery(
                    f"The function {name}() is not accepted: it reads outside Tollgate's tables."
                )


def _check_table(name: str, database: str) -> None:
    db, dot, _table = name.partition(".")
    if dot and db.strip('`"') != database and name not in _DUMMY_TABLES:
        raise RefusedQuery(
            f"The table {name} is not accepted: queries read Tollgate's tables in "
            f"`{database}` only."
        )


def vet(
    sql: str,
    parameters: dict[str, Any],
    database: str,
    explain: Callable[[str, dict[str, Any]], str],
) -> None:
    """Raise :class:`RefusedQuery` unless ``sql`` is one SELECT on Tollgate's tables.

    ``explain(statement, parameters)`` runs a statement and returns its
    output as text, one row a line; ClickHouse errors propagate.
    """
    # One statement: ClickHouse's parser, given the text as a value, says so.
    explain("SELECT formatQuery({tollgate_statement:String})", {"tollgate_statement": sql})
    check_ast(explain(f"EXPLAIN AST {sql}", parameters), database)
    check_query_tree(explain(f"EXPLAIN QUERY TREE {sql}", parameters), database)
