"""Set-at-a-time writes for the claim path: one statement per table per batch.

SQLite takes an `executemany` straight to the driver (no per-row parameter processing);
PostgreSQL takes one statement over `unnest` of column arrays, so a batch of claims costs a
handful of round trips instead of one per row. Constraints still check every row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Boolean, Connection, Float, Integer, Table
from sqlalchemy.exc import DBAPIError

__all__ = ["BulkWriter"]


def _pg_array_type(table: Table, column: str) -> str:
    kind = table.c[column].type
    if isinstance(kind, Boolean):
        return "bool[]"
    if isinstance(kind, Integer):
        return "int8[]"
    if isinstance(kind, Float):
        return "float8[]"
    return "text[]"


class BulkWriter:
    """Builds and caches the per-dialect SQL for inserts and additive updates."""

    def __init__(self, dialect: str) -> None:
        self.pg = dialect == "postgresql"
        self._sql: dict[tuple[object, ...], str] = {}

    def insert(
        self,
        conn: Connection,
        table: Table,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        *,
        on_conflict: str = "",
    ) -> int:
        """Insert rows (tuples in `columns` order); returns the rows the database reports."""
        if not rows:
            return 0
        return self._run(conn, self._insert_sql(table, columns, on_conflict), rows)

    def insert_returning(
        self,
        conn: Connection,
        table: Table,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        returning: str,
        on_conflict: str = "",
    ) -> list[tuple[Any, ...]]:
        """PostgreSQL only (SQLite's `executemany` returns no rows): `insert`, returning
        the `returning` columns of each row inserted, or updated by `on_conflict`."""
        assert self.pg
        if not rows:
            return []
        sql = self._insert_sql(table, columns, on_conflict) + f" RETURNING {returning}"
        with self._pg_cursor(conn, sql, rows) as cursor:
            return [tuple(r) for r in cursor.fetchall()]

    def _insert_sql(self, table: Table, columns: Sequence[str], on_conflict: str) -> str:
        key = ("insert", table.name, tuple(columns), on_conflict)
        sql = self._sql.get(key)
        if sql is None:
            names = ", ".join(columns)
            if self.pg:
                arrays = ", ".join(f"%b::{_pg_array_type(table, c)}" for c in columns)
                body = f"SELECT * FROM unnest({arrays})"
            else:
                body = "VALUES (" + ", ".join("?" for _ in columns) + ")"
            sql = self._sql[key] = f"INSERT INTO {table.name} ({names}) {body} {on_conflict}"
        return sql

    def add(
        self,
        conn: Connection,
        table: Table,
        keys: Sequence[str],
        column: str,
        rows: Sequence[Sequence[Any]],
    ) -> int:
        """`column += delta` for rows of (*key values, delta); keys must be unique in `rows`.

        Returns how many table rows changed, so a caller can tell a missing row from a hit.
        """
        if not rows:
            return 0
        key = ("add", table.name, tuple(keys), column)
        sql = self._sql.get(key)
        if sql is None:
            if self.pg:
                arrays = ", ".join(f"%b::{_pg_array_type(table, c)}" for c in (*keys, column))
                aliases = ", ".join((*keys, "delta"))
                match = " AND ".join(f"t.{k} = d.{k}" for k in keys)
                sql = (
                    f"UPDATE {table.name} AS t SET {column} = t.{column} + d.delta "
                    f"FROM unnest({arrays}) AS d({aliases}) WHERE {match}"
                )
            else:
                match = " AND ".join(f"{k} = ?" for k in keys)
                sql = f"UPDATE {table.name} SET {column} = {column} + ? WHERE {match}"
            self._sql[key] = sql
        if not self.pg:
            rows = [(*r[len(keys) :], *r[: len(keys)]) for r in rows]
        return self._run(conn, sql, rows)

    def _run(self, conn: Connection, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        if self.pg:
            with self._pg_cursor(conn, sql, rows) as cursor:
                return int(cursor.rowcount)
        return int(conn.exec_driver_sql(sql, [tuple(r) for r in rows]).rowcount)

    @contextmanager
    def _pg_cursor(
        self, conn: Connection, sql: str, rows: Sequence[Sequence[Any]]
    ) -> Iterator[Any]:
        """The driver's cursor, having run `sql` over the rows as column arrays."""
        columns = tuple(list(col) for col in zip(*rows, strict=True))
        # %b placeholders send arrays in binary, without quoting each element.
        raw = conn.connection.driver_connection
        assert raw is not None
        dbapi = conn.dialect.loaded_dbapi
        try:
            with raw.cursor() as cursor:
                cursor.execute(sql, columns)
                yield cursor
        except dbapi.Error as exc:
            # The same wrapper SQLAlchemy raises for its own statements.
            raise DBAPIError.instance(sql, columns, exc, dbapi.Error) from exc
