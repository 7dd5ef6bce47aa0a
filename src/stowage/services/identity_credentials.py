"""Keystone's v3 credentials (/v3/credentials) and a user's EC2 credentials (OS-EC2).

A "credential" document holds the user, the project, the type and the blob sealed (encrypted
with the cloud's credential key: services/tokens.py), so the database never holds a secret in
the clear; the blob is opened only to be shown to whom Keystone's policy lets see it. An EC2
credential is one of type "ec2" whose blob holds an access key and a secret, and whose id is
the SHA-256 of its access key, as in Keystone.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from typing import Any

from stowage.domain.errors import InvalidSpec, NotFound
from stowage.ledger.objects import Document
from stowage.services.cloud import Cloud
from stowage.services.identity import IdentityDirectory

__all__ = ["Credentials", "not_found"]

KIND = "credential"
_FIELDS = {"user_id", "project_id", "type", "blob"}


def _invalid(field: str, why: str) -> InvalidSpec:
    return InvalidSpec(f"Invalid input for field '{field}': {why}", code="identity.invalid")


def not_found(credential_id: str) -> NotFound:
    return NotFound(
        f"Could not find credential: {credential_id}.", code="identity.credential.not_found"
    )


def ec2_id(access: str) -> str:
    return hashlib.sha256(access.encode()).hexdigest()


class Credentials:
    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud
        self.directory = IdentityDirectory(cloud)

    def blob(self, doc: Document) -> str:
        return self.cloud.tokens.unseal(str(doc.body["sealed_blob"]))

    def _ec2_blob(self, project_id: Any, blob: str) -> dict[str, Any]:
        try:
            parsed = json.loads(blob)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("access"), str):
            raise _invalid("blob", "an ec2 credential's blob is a JSON object with an access key")
        if not project_id:
            raise _invalid("project_id", "an ec2 credential needs a project")
        return parsed

    def credential(self, credential_id: str) -> Document:
        doc = self.cloud.objects.find(KIND, credential_id)
        if doc is None:
            raise not_found(credential_id)
        return doc

    def all(self, *, user_id: str | None = None, type: str | None = None) -> list[Document]:
        return [
            d
            for d in self.cloud.objects.list(KIND)
            if (user_id is None or d.body["user_id"] == user_id)
            and (type is None or d.body["type"] == type)
        ]

    def create(self, fields: Mapping[str, Any]) -> Document:
        unknown = sorted(set(fields) - _FIELDS - {"id", "links"})
        if unknown:
            raise _invalid(unknown[0], "not an attribute of a credential")
        user_id, kind, blob = fields.get("user_id"), fields.get("type"), fields.get("blob")
        project_id = fields.get("project_id")
        if not isinstance(user_id, str) or not user_id:
            raise _invalid("user_id", "required")
        if not isinstance(kind, str) or not kind or len(kind) > 255:
            raise _invalid("type", "a string of 1 to 255 characters")
        if not isinstance(blob, str):
            raise _invalid("blob", f"{blob!r} is not of type 'string'")
        if project_id is not None and not isinstance(project_id, str):
            raise _invalid("project_id", f"{project_id!r} is not of type 'string', 'null'")
        self.directory.user(user_id)
        if project_id:
            self.directory.project(project_id)
        credential_id = uuid.uuid4().hex
        if kind == "ec2":
            credential_id = ec2_id(self._ec2_blob(project_id, blob)["access"])
        return self._store(credential_id, user_id, project_id or None, kind, blob)

    def _store(
        self, credential_id: str, user_id: str, project_id: str | None, kind: str, blob: str
    ) -> Document:
        body = {
            "user_id": user_id,
            "project_id": project_id,
            "type": kind,
            "sealed_blob": self.cloud.tokens.seal(blob),
        }
        return self.cloud.objects.create(KIND, credential_id, body)

    def update(self, credential_id: str, changes: Mapping[str, Any]) -> Document:
        doc = self.credential(credential_id)
        unknown = sorted(set(changes) - _FIELDS - {"id", "links"})
        if unknown:
            raise _invalid(unknown[0], "not an attribute of a credential")
        body = dict(doc.body)
        blob = self.blob(doc)
        if "blob" in changes:
            if not isinstance(changes["blob"], str):
                raise _invalid("blob", "is not of type 'string'")
            blob = changes["blob"]
        if "user_id" in changes:
            self.directory.user(str(changes["user_id"]))
            body["user_id"] = changes["user_id"]
        if "project_id" in changes:
            if changes["project_id"]:
                self.directory.project(str(changes["project_id"]))
            body["project_id"] = changes["project_id"] or None
        if "type" in changes:
            if not isinstance(changes["type"], str) or not changes["type"]:
                raise _invalid("type", "a string of 1 to 255 characters")
            body["type"] = changes["type"]
        if body["type"] == "ec2":
            # The id stays (Keystone's); what scopes the credential may not change.
            new = self._ec2_blob(body["project_id"], blob)
            try:
                old = json.loads(self.blob(doc))
            except ValueError:
                old = {}
            for key in ("trust_id", "app_cred_id", "access_token_id", "access_id"):
                if isinstance(old, dict) and old.get(key) != new.get(key):
                    raise _invalid("blob", f"{key} can not be updated for credential")
        body["sealed_blob"] = self.cloud.tokens.seal(blob)
        return self.cloud.objects.update(KIND, doc.id, body)

    def delete(self, credential_id: str) -> None:
        self.credential(credential_id)
        self.cloud.objects.delete(KIND, credential_id)

    # -- OS-EC2 -------------------------------------------------------------------------

    def create_ec2(self, user_id: str, project_id: Any) -> tuple[Document, dict[str, Any]]:
        """A new access key and secret for the user on a project it holds a role on."""
        self.directory.user(user_id)
        if not isinstance(project_id, str) or not project_id:
            raise _invalid("tenant_id", "required")
        self.directory.project(project_id)
        if not self.cloud.roles_of(user_id, project_id):
            raise NotFound(
                f"Could not find role assignment for user {user_id} on project {project_id}.",
                code="identity.role_assignment.not_found",
            )
        access = uuid.uuid4().hex
        blob: dict[str, Any] = {
            "access": access,
            "secret": uuid.uuid4().hex,
            "trust_id": None,
            "app_cred_id": None,
            "access_token_id": None,
        }
        doc = self._store(ec2_id(access), user_id, project_id, "ec2", json.dumps(blob))
        return doc, blob

    def ec2(self, user_id: str, access: str) -> tuple[Document, dict[str, Any]]:
        self.directory.user(user_id)
        for doc, blob in self.ec2_of(user_id):
            if blob.get("access") == access:
                return doc, blob
        raise not_found(access)

    def ec2_of(self, user_id: str) -> list[tuple[Document, dict[str, Any]]]:
        self.directory.user(user_id)
        out = []
        for doc in self.all(user_id=user_id, type="ec2"):
            try:
                out.append((doc, json.loads(self.blob(doc))))
            except ValueError:
                continue
        return out

    def delete_ec2(self, user_id: str, access: str) -> None:
        doc, _ = self.ec2(user_id, access)
        self.cloud.objects.delete(KIND, doc.id)
