"""Paging and the newer filters of os-migrations (2.59, 2.66, 2.80) and os-simple-tenant-usage
(2.40): limit, marker, changes-since / changes-before, user_id and project_id."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from stowage.api.common import ApiError
from stowage.ledger.objects import Document

__all__ = ["page", "page_migrations", "query_stamp"]

Version = tuple[int, int]


def _limit(raw: str | None, what: str = "limit") -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"Invalid input for query parameters {what}. Value: {raw}.") from None
    if value < 0:
        raise ApiError(400, f"Invalid input for query parameters {what}. Value: {raw}.")
    return value


def query_stamp(raw: str, what: str) -> float:
    """An ISO 8601 time of a query parameter (UTC when it names no zone), or Nova's 400."""
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(400, f"Invalid input for query parameters {what}. Value: {raw}.") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def page(docs: list[Document], query: Any, not_found: str) -> tuple[list[Document], str | None]:
    """Docs after `marker` (an id; 400 when it is not among them), at most `limit`; with the
    id of the last one shown when more remain (for a `next` link)."""
    marker = query.get("marker")
    if marker:
        ids = [d.id for d in docs]
        if marker not in ids:
            raise ApiError(400, not_found.format(marker=marker))
        docs = docs[ids.index(marker) + 1 :]
    limit = _limit(query.get("limit"))
    if limit is None or len(docs) <= limit:
        return docs, None
    docs = docs[:limit]
    return docs, (docs[-1].id if docs else None)


def page_migrations(
    docs: list[Document], query: Any, version: Version, base_url: str
) -> tuple[list[Document], list[dict[str, str]]]:
    """os-migrations' 2.59+ query: changes-since, changes-before (2.66), user_id and
    project_id (2.80), then marker (a migration uuid) and limit."""
    if version < (2, 59):
        return docs, []
    since = query.get("changes-since")
    if since:
        after = query_stamp(since, "changes-since")
        docs = [d for d in docs if d.updated_at >= after]
    before_raw = query.get("changes-before") if version >= (2, 66) else None
    if before_raw:
        before = query_stamp(before_raw, "changes-before")
        if since and query_stamp(since, "changes-since") > before:
            raise ApiError(
                400, "The value of changes-since must be less than or equal to changes-before."
            )
        docs = [d for d in docs if d.updated_at <= before]
    if version >= (2, 80):
        for key in ("user_id", "project_id"):
            wanted = query.get(key)
            if wanted:
                docs = [d for d in docs if d.body.get(key) == wanted]
    docs, last = page(docs, query, "Marker {marker} could not be found.")
    links = []
    if last is not None:
        limit = query.get("limit")
        links = [
            {
                "rel": "next",
                "href": f"{base_url}/compute/v2.1/os-migrations?limit={limit}&marker={last}",
            }
        ]
    return docs, links
