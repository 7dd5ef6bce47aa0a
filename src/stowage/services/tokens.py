"""Signed, expiring tokens (Fernet, as Keystone uses) and password hashing."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.fernet import Fernet, InvalidToken

__all__ = [
    "TokenError",
    "TokenPayload",
    "Tokens",
    "ValidationCache",
    "hash_password",
    "verify_password",
]

_SCRYPT_N = 2**14  # slow enough to make guessing expensive, fast enough for a CLI per call
_SCRYPT_R = 8
_SCRYPT_P = 1


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    salt = salt or os.urandom(16)
    digest = hashlib.scrypt(
        password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32
    )
    return "scrypt$" + base64.b64encode(salt).decode() + "$" + base64.b64encode(digest).decode()


def verify_password(password: str, stored: str) -> bool:
    try:
        scheme, salt_b64, digest_b64 = stored.split("$")
    except ValueError:
        return False
    if scheme != "scrypt":
        return False
    salt = base64.b64decode(salt_b64)
    digest = hashlib.scrypt(
        password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32
    )
    return hmac.compare_digest(digest, base64.b64decode(digest_b64))


class TokenError(Exception):
    """The token is malformed, forged or expired."""


@dataclass(frozen=True, slots=True)
class TokenPayload:
    user_id: str
    project_id: str
    roles: tuple[str, ...]
    issued_at: float
    expires_at: float
    audit_id: str
    methods: tuple[str, ...] = ("password",)
    # The first token of a chain of rescopings (Keystone's audit_chain_id); empty for the first.
    audit_chain_id: str = ""
    # A domain-scoped token's domain (project_id is then empty); empty for any other.
    domain_id: str = ""

    @property
    def audit_ids(self) -> list[str]:
        """Keystone's `audit_ids`: this token's, then its chain's when it was rescoped."""
        return [self.audit_id, self.audit_chain_id] if self.audit_chain_id else [self.audit_id]


class Tokens:
    """Issues and validates tokens with a key kept in the state directory."""

    def __init__(
        self, key: bytes, *, ttl_s: float = 3600.0, clock: Callable[[], float] = time.time
    ) -> None:
        self._fernet = Fernet(key)
        # Stored secrets (credential blobs) are sealed with a key of their own, derived from
        # the token key, so that a sealed secret is never a token and a token never opens one.
        derived = hashlib.sha256(b"stowage-credentials\0" + key).digest()
        self._sealer = Fernet(base64.urlsafe_b64encode(derived))
        self.ttl_s = ttl_s
        self.clock = clock

    def seal(self, secret: str) -> str:
        return self._sealer.encrypt(secret.encode()).decode()

    def unseal(self, sealed: str) -> str:
        return self._sealer.decrypt(sealed.encode()).decode()

    @staticmethod
    def new_key() -> bytes:
        return Fernet.generate_key()

    def issue(
        self,
        user_id: str,
        project_id: str,
        roles: tuple[str, ...],
        *,
        methods: tuple[str, ...],
        parent: TokenPayload | None = None,
        domain_id: str = "",
    ) -> tuple[str, TokenPayload]:
        """A new token; one rescoped from `parent` keeps its expiry and joins its audit chain,
        so a token cannot be renewed for ever by rescoping it (as in Keystone)."""
        now = self.clock()
        payload = TokenPayload(
            user_id=user_id,
            project_id=project_id,
            roles=roles,
            issued_at=now,
            expires_at=now + self.ttl_s if parent is None else parent.expires_at,
            audit_id=secrets.token_urlsafe(16),
            methods=methods,
            audit_chain_id="" if parent is None else parent.audit_chain_id or parent.audit_id,
            domain_id=domain_id,
        )
        raw = json.dumps(
            {
                "u": payload.user_id,
                "p": payload.project_id,
                "r": list(payload.roles),
                "i": payload.issued_at,
                "e": payload.expires_at,
                "a": payload.audit_id,
                "m": list(payload.methods),
                "c": payload.audit_chain_id,
                "d": payload.domain_id,
            }
        ).encode()
        return self._fernet.encrypt(raw).decode(), payload

    def validate(self, token: str) -> TokenPayload:
        try:
            raw = self._fernet.decrypt(token.encode())
        except (InvalidToken, ValueError):
            raise TokenError("The request you have made requires authentication.") from None
        data = json.loads(raw)
        payload = TokenPayload(
            user_id=data["u"],
            project_id=data["p"],
            roles=tuple(data["r"]),
            issued_at=data["i"],
            expires_at=data["e"],
            audit_id=data["a"],
            methods=tuple(data.get("m", ["password"])),
            audit_chain_id=str(data.get("c", "")),
            domain_id=str(data.get("d", "")),
        )
        if payload.expires_at <= self.clock():
            raise TokenError("The token has expired.")
        return payload


class ValidationCache:
    """Tokens validated lately, so a request does not read the database three times (the
    revocation list, the user, the project) to learn what the last one learned.

    An entry lives `ttl_s` at most, and none outlives a change this process makes to a
    revocation, a user or a project (the document store calls `changed()`): a token revoked
    or a user disabled here is refused at once. A change made by another process (another API
    worker) is seen within `ttl_s`, as keystonemiddleware's token cache does (for 300 s by
    default there). A validation that began before a change is not cached after it.
    """

    def __init__(
        self,
        *,
        ttl_s: float = 2.0,
        size_max: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.size_max = size_max
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, object]] = {}
        self._generation = 0

    @property
    def generation(self) -> int:
        """Read before validating; hand it to `put`."""
        return self._generation

    def get(self, token: str) -> object | None:
        entry = self._entries.get(token)
        if entry is None:
            return None
        if self.clock() - entry[0] > self.ttl_s:
            with self._lock:
                self._entries.pop(token, None)
            return None
        return entry[1]

    def put(self, token: str, value: object, generation: int) -> None:
        with self._lock:
            if generation != self._generation or self.ttl_s <= 0:
                return  # something changed while it was validated
            if len(self._entries) >= self.size_max:
                self._entries.clear()
            self._entries[token] = (self.clock(), value)

    def changed(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries.clear()
