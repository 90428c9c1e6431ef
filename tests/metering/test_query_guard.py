"""Analysts' SQL: only SELECTs on Tollgate's tables, within the service's limits.

Each refusal is decided from ClickHouse's own parse of the statement (on the
embedded engine here) and comes back as a clear error, never a stack trace.
"""

from __future__ import annotations

import pytest

from services.metering import sqlguard
from services.metering.store import UsageStore

REFUSED = {
    "file": ("SELECT * FROM file('/etc/hostname', 'LineAsString')", "table function file()"),
    "file_scalar": ("SELECT file('/etc/hostname')", "function file()"),
    "url": ("SELECT * FROM url('http://127.0.0.1:1/', 'LineAsString')", "table function url()"),
    "s3": ("SELECT * FROM s3('http://127.0.0.1:1/b/k')", "table function s3()"),
    "remote": ("SELECT * FROM remote('127.0.0.1', system.one)", "table function remote()"),
    "system_users": ("SELECT * FROM system.users", "system.users"),
    "system_in": ("SELECT 1 WHERE 'x' IN (SELECT name FROM system.users)", "system.users"),
    "system_in_table": ("SELECT count() FROM usage_events WHERE 0 IN system.zeros", "system.zeros"),
    # A constant subquery is evaluated while the statement is analysed: its
    # table must be refused before (else the error below tells a member apart).
    "system_in_constant_subquery": (
        "SELECT (SELECT throwIf(count() > 0, 'member')"
        " WHERE 'alexey-milovidov' IN system.contributors)",
        "system.contributors",
    ),
    "system_global_not_in": (
        "SELECT 1 WHERE 'x' GLOBAL NOT IN `system`.`contributors`",
        "system",
    ),
    "information_schema": ("SELECT * FROM information_schema.tables", "information_schema"),
    "view": ("SELECT * FROM view(SELECT * FROM system.users)", "table function view()"),
    "settings": (
        "SELECT count() FROM usage_events SETTINGS max_execution_time = 0",
        "SETTINGS clause",
    ),
    "settings_in_subquery": (
        "SELECT * FROM (SELECT count() FROM usage_events SETTINGS max_result_rows = 0)",
        "SETTINGS clause",
    ),
    # ClickHouse itself refuses this one while parsing (the connection is read-only).
    "readonly": ("SELECT 1 SETTINGS readonly = 0", "readonly"),
    "set": ("SET max_execution_time = 0", "single SELECT"),
    "insert": ("INSERT INTO usage_events (request_id, tenant) VALUES ('x', 'x')", "single SELECT"),
    "temporary_table": ("CREATE TEMPORARY TABLE t (x UInt8)", "single SELECT"),
    "create": ("CREATE TABLE sneaky (a UInt8) ENGINE = Memory", "single SELECT"),
    "drop": ("DROP TABLE usage_events", "single SELECT"),
    "alter": ("ALTER TABLE usage_events DELETE WHERE 1", "single SELECT"),
    "multi_statement": ("SELECT 1; DROP TABLE usage_events", "Multi-statements"),
    "outfile": ("SELECT 1 INTO OUTFILE '/tmp/tollgate-outfile'", "INTO OUTFILE"),
    "format": ("SELECT count() FROM usage_events FORMAT JSONEachRow", "--format"),
    "other_database": ("SELECT * FROM default.anything", "default.anything"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_statements_outside_the_analysts_rights_are_refused(store: UsageStore, case: str) -> None:
    sql, says = REFUSED[case]
    result = store.query(sql, {}, max_rows=10)
    assert result.error is not None, (sql, result)
    assert says in result.error, (sql, result.error)
    assert "Traceback" not in result.error and "Stack trace" not in result.error
    assert not result.rows
    # Nothing was changed on the way.
    assert store.writer.query("SELECT count() FROM usage_events").result_rows == [(0,)]
    assert (
        store.writer.query(
            "SELECT count() FROM system.tables WHERE database = {d:String}",
            parameters={"d": store.database},
        ).result_rows[0][0]
        > 0
    )


def test_the_format_error_points_at_the_cli_option(store: UsageStore) -> None:
    result = store.query("SELECT 1 AS one FORMAT JSONEachRow", {}, 10)
    assert result.error == sqlguard.FORMAT_HINT


def test_selects_on_tollgates_tables_still_run(store: UsageStore) -> None:
    accepted = [
        "SELECT 1",
        "SELECT 1;",
        "WITH 2 AS x SELECT x UNION ALL SELECT 3",
        f"SELECT count() FROM {store.database}.usage_events",
        "SELECT number FROM numbers(3)",
        "SELECT count() FROM usage_events WHERE tenant = {tenant:String}  -- a comment",
        "SELECT 1 INTERSECT SELECT 1",
    ]
    for sql in accepted:
        result = store.query(sql, {"tenant": "acme"}, 10)
        assert result.error is None, (sql, result.error)
        assert result.rows, sql


def test_a_parameter_with_any_line_break_is_vetted_as_one_value(store: UsageStore) -> None:
    """EXPLAIN's tree has a node a line; a literal's vertical tab, form feed or Unicode
    line separator is no line end (str.splitlines would take it for one)."""
    sql = "SELECT count() FROM usage_events WHERE tenant = {tenant:String}"
    for odd in ("\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r", "\n"):
        result = store.query(sql, {"tenant": f"a{odd}b"}, 10)
        assert result.error is None, (repr(odd), result.error)
        assert result.rows == [[0]]


def test_the_reader_is_read_only_in_clickhouse_itself(store: UsageStore) -> None:
    """Behind the vetting, the connection still refuses writes and settings changes."""
    reader = store._reader
    assert reader is not None
    for sql in (
        "INSERT INTO usage_events (request_id, tenant) VALUES ('x', 'x')",
        "SET readonly = 0",
    ):
        with pytest.raises(Exception, match=r"(?i)readonly"):
            reader.command(sql)


def test_ast_checks_read_clickhouses_tree() -> None:
    dump = "\n".join(
        [
            "SelectWithUnionQuery (children 2)",
            " ExpressionList (children 1)",
            "  SelectQuery (children 2)",
            "   ExpressionList (children 1)",
            "    Asterisk",
            "   TablesInSelectQuery (children 1)",
            "    TablesInSelectQueryElement (children 1)",
            "     TableExpression (children 1)",
            "      Function executable (children 1)",
        ]
    )
    with pytest.raises(sqlguard.RefusedQuery, match="executable"):
        sqlguard.check_ast(dump, "tollgate")
    tree = "QUERY id: 0\n  JOIN TREE\n    TABLE id: 3, alias: __table1, table_name: other.t"
    with pytest.raises(sqlguard.RefusedQuery, match=r"other\.t"):
        sqlguard.check_query_tree(tree, "tollgate")
    sqlguard.check_query_tree(tree.replace("other.t", "tollgate.t"), "tollgate")
