"""Operators' control documents (``onceonly.stores.base.ControlStore``): the table ``onceonly_controls``
(schema version 3, ``_schema``), a row per document, its JSON as text; a namespace is one ``SELECT``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from onceonly.stores._controls import decode_doc, encode_doc
from onceonly.stores.postgres._names import ident

if TYPE_CHECKING:
    from onceonly.stores.postgres._pools import AsyncConnection, Connection

T = TypeVar("T")


def controls_ddl(schema: str) -> list[str]:
    """The migration to schema version 3: the table of control documents."""
    return [
        f"""CREATE TABLE {ident(schema)}.onceonly_controls (
            ns   text COLLATE "C" NOT NULL,
            name text COLLATE "C" NOT NULL,
            doc  text NOT NULL,
            PRIMARY KEY (ns, name)
        )"""
    ]


class Controls:
    """``PostgresStore``'s control documents."""

    if TYPE_CHECKING:  # the store's
        schema: str
        _where: str

        def _on_connection(
            self, op: Callable[[Connection], T], rerun: bool = True, cursor: bool = False, writing: bool = True
        ) -> tuple[T, bool]: ...

        async def _aon_connection(
            self,
            op: Callable[[AsyncConnection], Awaitable[T]],
            rerun: bool = True,
            cursor: bool = False,
            writing: bool = True,
        ) -> tuple[T, bool]: ...

    def _controls_sql(self) -> tuple[str, str, str]:
        t = f"{ident(self.schema)}.onceonly_controls"
        return (
            f"SELECT name, doc FROM {t} WHERE ns = %s",
            f"INSERT INTO {t} (ns, name, doc) VALUES (%s, %s, %s) "
            "ON CONFLICT (ns, name) DO UPDATE SET doc = EXCLUDED.doc",
            f"DELETE FROM {t} WHERE ns = %s AND name = %s",
        )

    def controls(self, namespace: str) -> dict[str, dict[str, Any]]:
        select = self._controls_sql()[0]

        def op(conn: Connection) -> list[Any]:
            return conn.execute(select, (namespace,)).fetchall()

        rows, _ = self._on_connection(op, cursor=True, writing=False)
        return {name: decode_doc(name, doc, self._where) for name, doc in rows}

    async def acontrols(self, namespace: str) -> dict[str, dict[str, Any]]:
        select = self._controls_sql()[0]

        async def op(conn: AsyncConnection) -> list[Any]:
            return await (await conn.execute(select, (namespace,))).fetchall()

        rows, _ = await self._aon_connection(op, cursor=True, writing=False)
        return {name: decode_doc(name, doc, self._where) for name, doc in rows}

    def put_control(self, namespace: str, name: str, doc: Mapping[str, Any]) -> None:
        upsert = self._controls_sql()[1]
        text = encode_doc(namespace, name, doc)

        # Rerun after a lost connection: the upsert writes the same row however often it runs.
        def op(conn: Connection) -> None:
            conn.execute(upsert, (namespace, name, text))

        self._on_connection(op, cursor=True)

    def delete_control(self, namespace: str, name: str) -> bool:
        delete = self._controls_sql()[2]
        encode_doc(namespace, name, {})  # the same checks of the names as a write

        def op(conn: Connection) -> int:
            return conn.execute(delete, (namespace, name)).rowcount

        # A rerun after a lost connection may find the row gone by the first run: it answers False.
        count, _ = self._on_connection(op, cursor=True)
        return count == 1
