"""Placement's query-string grammar: resources, required traits, member_of."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stowage.api.common import ApiError
from stowage.api.placement.microversion import Version
from stowage.api.placement.support import valid_uuid
from stowage.services.placement import PlacementStore

__all__ = ["Aggregates", "Traits", "parse_member_of", "parse_required", "parse_resources"]

_BAD_VALUE = "placement.query.bad_value"
_RESOURCES_FORM = (
    "Badly formed resources parameter. Expected resources query string parameter in form: "
    "?resources=VCPU:2,MEMORY_MB:1024. Got: {got}."
)


def parse_resources(value: str, store: PlacementStore, *, key: str = "resources") -> dict[str, int]:
    """`VCPU:2,MEMORY_MB:1024` into amounts; every class must exist."""
    if not value.strip():
        raise ApiError(400, _RESOURCES_FORM.format(got="empty string"), code=_BAD_VALUE)
    out: dict[str, int] = {}
    for item in value.split(","):
        rc, sep, amount_text = item.partition(":")
        if not sep or not rc or ":" in amount_text:
            raise ApiError(400, _RESOURCES_FORM.format(got=item), code=_BAD_VALUE)
        try:
            amount = int(amount_text)
        except ValueError:
            raise ApiError(
                400,
                f"Requested resource {rc} expected positive integer amount. Got: {amount_text}.",
                code=_BAD_VALUE,
            ) from None
        if amount < 1:
            raise ApiError(
                400,
                f"Requested resource {rc} requires amount >= 1. Got: {amount}.",
                code=_BAD_VALUE,
            )
        if rc in out:
            raise ApiError(400, f"Resource class {rc} is given twice in {key}.", code=_BAD_VALUE)
        out[rc] = amount
    unknown = sorted(rc for rc in out if not store.resource_class_exists(rc))
    if unknown:
        raise ApiError(
            400,
            f"Invalid resource class in {key} parameter: No such resource class "
            f"{', '.join(unknown)}.",
            code=_BAD_VALUE,
        )
    return out


@dataclass(frozen=True, slots=True)
class Traits:
    required: frozenset[str] = frozenset()
    forbidden: frozenset[str] = frozenset()
    any_of: tuple[frozenset[str], ...] = ()

    @property
    def names(self) -> set[str]:
        out = set(self.required | self.forbidden)
        for group in self.any_of:
            out |= group
        return out


def parse_required(
    values: Sequence[str], version: Version, store: PlacementStore, *, key: str = "required"
) -> Traits:
    """`A,!B` (forbidden from 1.22) and `in:A,B` (any of, from 1.39); repeats are ANDed."""
    required: set[str] = set()
    forbidden: set[str] = set()
    any_of: list[frozenset[str]] = []
    for value in values:
        if value.startswith("in:") and version >= (1, 39):
            names = value[3:].split(",")
            if not all(names) or any(n.startswith("!") for n in names):
                raise _bad_traits(key, value)
            any_of.append(frozenset(names))
            continue
        for name in value.split(","):
            if name.startswith("!") and version >= (1, 22):
                forbidden.add(name[1:])
            else:
                required.add(name)
    if "" in required or "" in forbidden:
        raise _bad_traits(key, ",".join(values))
    both = sorted(required & forbidden)
    if both:
        raise ApiError(
            400,
            f"Conflicting required and forbidden traits found in the following traits "
            f"keys: {key}: ({', '.join(both)})",
            code=_BAD_VALUE,
        )
    traits = Traits(frozenset(required), frozenset(forbidden), tuple(any_of))
    unknown = store.unknown_traits(traits.names)
    if unknown:
        raise ApiError(
            400,
            f"Invalid trait(s) in {key!r} parameter: No such trait(s): {', '.join(unknown)}.",
            code=_BAD_VALUE,
        )
    return traits


def _bad_traits(key: str, value: str) -> ApiError:
    return ApiError(
        400,
        f"Invalid query string parameters: Expected '{key}' parameter value of the form: "
        f"HW_CPU_X86_VMX,CUSTOM_MAGIC. Got: {value}",
        code=_BAD_VALUE,
    )


@dataclass(frozen=True, slots=True)
class Aggregates:
    member_of: tuple[frozenset[str], ...] = ()
    forbidden: frozenset[str] = frozenset()


def parse_member_of(
    values: Sequence[str], version: Version, *, key: str = "member_of"
) -> Aggregates:
    """`in:A,B` or `A`, repeated (ANDed) from 1.24, `!A` / `!in:A,B` forbidden from 1.32."""
    if len(values) > 1 and version < (1, 24):
        raise ApiError(
            400,
            f"Multiple {key} parameters are not supported.",
            code="placement.query.duplicate_key",
        )
    member_of: list[frozenset[str]] = []
    forbidden: set[str] = set()
    for value in values:
        negative = value.startswith("!") and version >= (1, 32)
        text = value[1:] if negative else value
        if text.startswith("in:"):
            uuids = [valid_uuid(u, key) for u in text[3:].split(",")]
        else:
            uuids = [valid_uuid(text, key)]
        if negative:
            forbidden.update(uuids)
        else:
            member_of.append(frozenset(uuids))
    return Aggregates(tuple(member_of), frozenset(forbidden))
