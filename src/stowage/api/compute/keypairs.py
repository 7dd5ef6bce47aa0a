"""Compute v2.1: keypairs, per user; generated with `cryptography` when no public key is given."""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import string
import uuid
import zlib
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context, require_writer
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import ConflictError, QuotaExceeded
from stowage.ledger.objects import Document
from stowage.services import compute_catalog as catalog
from stowage.services import keypairs

__all__ = ["router"]

router = APIRouter()

_SAFE = set("_- " + string.digits + string.ascii_letters)
_SAFE_292 = _SAFE | {"@", "."}
_TYPES = ("ssh", "x509")


def _doc_id(user_id: str, name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-keypair:{user_id}/{name}"))


def _user(request: Request, ctx: Context, given: Any = None) -> str:
    """Whose keypairs: the caller's, or (2.10+, admins only) the user_id asked for."""
    wanted = given if given is not None else request.query_params.get("user_id")
    if wanted is None or mv(request) < (2, 10):
        return ctx.user_id
    if not isinstance(wanted, str) or not wanted:
        raise ApiError(400, f"Invalid input for field/attribute user_id: {wanted!r}")
    if wanted != ctx.user_id and not ctx.is_admin:
        raise ApiError(403, "Policy doesn't allow os_compute_api:os-keypairs to be performed.")
    return wanted


def _name(request: Request, value: Any) -> str:
    name = catalog.parse_name(value, "name")
    safe = _SAFE_292 if mv(request) >= (2, 92) else _SAFE
    if not set(name) <= safe:
        raise ApiError(400, "Keypair data is invalid: Keypair name contains unsafe characters")
    return name


def _colons(digest: str) -> str:
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def _fingerprint(kind: str, public_key: str) -> str:
    """Nova's fingerprints: MD5 of the SSH key blob, SHA-1 of an X.509 certificate."""
    invalid = ApiError(400, "Keypair data is invalid: failed to generate fingerprint")
    if kind == "x509":
        try:
            cert = x509.load_pem_x509_certificate(public_key.encode())
        except ValueError:
            raise invalid from None
        return _colons(cert.fingerprint(hashes.SHA1()).hex())
    try:
        serialization.load_ssh_public_key(public_key.strip().encode())
        blob = base64.b64decode(public_key.split()[1])
    except (ValueError, IndexError, UnsupportedAlgorithm, binascii.Error):
        raise invalid from None
    return _colons(hashlib.md5(blob, usedforsecurity=False).hexdigest())


def _generate(kind: str, user_id: str) -> tuple[str, str]:
    """A new private key (PEM) and its public half, as Nova generated them."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    ).decode()
    if kind == "ssh":
        public = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        return private, public.decode() + " Generated-by-Nova"
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, user_id or "stowage")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    return private, cert.public_bytes(serialization.Encoding.PEM).decode()


def _view(request: Request, doc: Document, *, full: bool) -> dict[str, Any]:
    body = doc.body
    out: dict[str, Any] = {
        "name": body["name"],
        "public_key": body["public_key"],
        "fingerprint": body["fingerprint"],
    }
    if full:
        out.update(
            {
                "user_id": body["user_id"],
                "created_at": catalog.iso(doc.created_at),
                "updated_at": None,
                "deleted": False,
                "deleted_at": None,
                "id": zlib.crc32(doc.id.encode()) & 0x7FFFFFFF,
            }
        )
    if mv(request) >= (2, 2):
        out["type"] = body.get("type", "ssh")
    return out


def _find(request: Request, user_id: str, name: str) -> Document:
    doc = cloud_of(request).objects.find("keypair", _doc_id(user_id, name))
    if doc is None:
        raise ApiError(404, f"Keypair {name} not found for user {user_id}")
    return doc


@router.post("/os-keypairs")
async def create_keypair(request: Request) -> JSONResponse:
    ctx = require_writer(request)
    cloud = cloud_of(request)
    version = mv(request)
    payload = catalog.member(await json_body(request), "keypair")
    allowed = {"name", "public_key"}
    if version >= (2, 2):
        allowed.add("type")
    if version >= (2, 10):
        allowed.add("user_id")
    catalog.only_keys(payload, allowed, "keypair")
    if "name" not in payload:
        raise ApiError(400, "Invalid input for field/attribute keypair: 'name' is required")
    if version >= (2, 92) and "public_key" not in payload:
        raise ApiError(
            400, "Invalid input for field/attribute keypair: 'public_key' is a required property"
        )
    name = _name(request, payload["name"])
    user_id = _user(request, ctx, payload.get("user_id"))
    kind = payload.get("type", "ssh")
    if kind not in _TYPES:
        raise ApiError(
            400, f"Invalid input for field/attribute type: {kind!r} is not one of ssh, x509"
        )
    private_key = None
    public_key = payload.get("public_key")
    if public_key is None:
        private_key, public_key = _generate(kind, user_id)
    elif not isinstance(public_key, str) or not public_key.strip():
        raise ApiError(400, "Keypair data is invalid: failed to generate fingerprint")
    body = {
        "name": name,
        "user_id": user_id,
        "public_key": public_key,
        "fingerprint": _fingerprint(kind, public_key),
        "type": kind,
    }
    try:
        doc = keypairs.create_keypair(cloud, _doc_id(user_id, name), ctx.project_id, body)
    except QuotaExceeded as exc:
        raise ApiError(403, str(exc)) from None
    except ConflictError as exc:
        raise ApiError(409, str(exc)) from None
    out = _view(request, doc, full=False)
    out["user_id"] = user_id
    if private_key is not None:
        out["private_key"] = private_key
    return JSONResponse({"keypair": out}, status_code=201 if version >= (2, 2) else 200)


@router.get("/os-keypairs")
async def list_keypairs(request: Request) -> JSONResponse:
    ctx = require_context(request)
    user_id = _user(request, ctx)
    docs = [
        d for d in cloud_of(request).objects.list("keypair") if d.body.get("user_id") == user_id
    ]
    docs.sort(key=lambda d: d.body["name"])
    body: dict[str, Any] = {}
    if mv(request) >= (2, 35):
        marker = request.query_params.get("marker")
        if marker is not None:
            names = [d.body["name"] for d in docs]
            if marker not in names:
                raise ApiError(400, f"marker [{marker}] not found")
            docs = docs[names.index(marker) + 1 :]
        raw = request.query_params.get("limit")
        if raw is not None:
            limit = catalog.parse_int(raw, "limit", minimum=0)
            docs = docs[: limit or 1000]
            if limit and len(docs) == limit:
                base = cloud_of(request).config.base_url
                href = (
                    f"{base}/compute/v2.1/os-keypairs?limit={limit}&marker={docs[-1].body['name']}"
                )
                body["keypairs_links"] = [{"rel": "next", "href": href}]
    body["keypairs"] = [{"keypair": _view(request, d, full=False)} for d in docs]
    return JSONResponse(body)


@router.get("/os-keypairs/{name}")
async def show_keypair(name: str, request: Request) -> JSONResponse:
    ctx = require_context(request)
    doc = _find(request, _user(request, ctx), name)
    return JSONResponse({"keypair": _view(request, doc, full=True)})


@router.delete("/os-keypairs/{name}")
async def delete_keypair(name: str, request: Request) -> Response:
    ctx = require_writer(request)
    doc = _find(request, _user(request, ctx), name)
    keypairs.delete_keypair(cloud_of(request), doc.id)
    return Response(status_code=204 if mv(request) >= (2, 2) else 202)
