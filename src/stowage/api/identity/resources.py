"""Domains, projects, users and roles: list, show, create, update, delete as Keystone v3 does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.common import ApiError, json_body
from stowage.api.identity.policy import Caller, admin, caller, directory, forbid
from stowage.api.identity.views import (
    base_of,
    collection,
    domain_view,
    envelope,
    keep,
    matches_name,
    project_view,
    role_view,
    user_view,
)
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services.identity import IdentityDirectory, check_tags

__all__ = ["router"]

router = APIRouter()

_GET_HEAD = ["GET", "HEAD"]


_View = Callable[[str, Document], dict[str, Any]]
_Create = Callable[[IdentityDirectory, Mapping[str, Any]], Document]
_Update = Callable[[IdentityDirectory, str, Mapping[str, Any]], Document]


def _one(key: str, view: dict[str, Any], status: int = 200) -> JSONResponse:
    return JSONResponse({key: view}, status_code=status)


def _listing(request: Request, key: str, docs: list[Document], view: _View) -> JSONResponse:
    base = base_of(request)
    return JSONResponse(collection(request, key, docs, lambda d: view(base, d)))


def _seen(doc: Document, may_see: Callable[[str], bool], action: str) -> Document:
    """The document, if the caller may see it; otherwise a 403 naming the policy rule."""
    if not may_see(doc.id):
        raise forbid(f"identity:{action}")
    return doc


async def _create(request: Request, kind: str, view: _View, create: _Create) -> JSONResponse:
    """POST /v3/{kind}s: an admin's, answered 201 with the new resource."""
    who = admin(request, f"create_{kind}")
    doc = create(who.directory, await envelope(request, kind))
    return _one(kind, view(base_of(request), doc), 201)


async def _update(
    request: Request, kind: str, ref: str, view: _View, update: _Update
) -> JSONResponse:
    """PATCH /v3/{kind}s/{ref}: an admin's, answered with the changed resource."""
    who = admin(request, f"update_{kind}")
    doc = update(who.directory, ref, await envelope(request, kind))
    return _one(kind, view(base_of(request), doc))


# -- domains --------------------------------------------------------------------------------


@router.get("/v3/domains")
async def list_domains(request: Request) -> JSONResponse:
    who = caller(request)
    docs = [
        d
        for d in who.directory.domains()
        if who.may_see_domain(d.id)
        and matches_name(request, d.body.get("name", ""))
        and keep(request, d, {"enabled": "enabled"})
    ]
    return _listing(request, "domains", docs, domain_view)


@router.post("/v3/domains")
async def create_domain(request: Request) -> JSONResponse:
    return await _create(request, "domain", domain_view, IdentityDirectory.create_domain)


@router.api_route("/v3/domains/{domain_id}", methods=_GET_HEAD)
async def show_domain(request: Request, domain_id: str) -> JSONResponse:
    who = caller(request)
    doc = _seen(who.directory.domain(domain_id), who.may_see_domain, "get_domain")
    return _one("domain", domain_view(base_of(request), doc))


@router.patch("/v3/domains/{domain_id}")
async def update_domain(request: Request, domain_id: str) -> JSONResponse:
    return await _update(request, "domain", domain_id, domain_view, IdentityDirectory.update_domain)


@router.delete("/v3/domains/{domain_id}")
async def delete_domain(request: Request, domain_id: str) -> Response:
    admin(request, "delete_domain").directory.delete_domain(domain_id)
    return Response(status_code=204)


# -- projects -------------------------------------------------------------------------------


def _tags_match(request: Request, doc: Document) -> bool:
    params = request.query_params
    tags = set(doc.body.get("tags", []))

    def wanted(key: str) -> set[str] | None:
        return set(params[key].split(",")) if key in params else None

    all_of, any_of = wanted("tags"), wanted("tags-any")
    none_of, not_any = wanted("not-tags"), wanted("not-tags-any")
    return (
        (all_of is None or all_of <= tags)
        and (any_of is None or bool(any_of & tags))
        and (none_of is None or not none_of <= tags)
        and (not_any is None or not not_any & tags)
    )


@router.get("/v3/projects")
async def list_projects(request: Request) -> JSONResponse:
    who = caller(request)
    if not who.reads_all:
        # Keystone's identity:list_projects is a system (or domain) reader's; a project
        # member lists their own through /v3/auth/projects or /v3/users/{id}/projects.
        raise forbid("identity:list_projects")
    if "is_domain" in request.query_params and _wants_domains(request):
        docs: list[Document] = []  # no project here acts as a domain
    else:
        docs = [
            p
            for p in who.directory.projects()
            if matches_name(request, p.body.get("name", ""))
            and keep(request, p, {"domain_id": "domain_id", "enabled": "enabled"})
            and _parent_matches(request, p)
            and _tags_match(request, p)
        ]
    return _listing(request, "projects", docs, project_view)


def _wants_domains(request: Request) -> bool:
    """`?is_domain=true` asks for projects acting as domains, and there are none here."""
    return request.query_params["is_domain"].strip().lower() in {"1", "true", "t", "yes", "y", "on"}


def _parent_matches(request: Request, project: Document) -> bool:
    wanted = request.query_params.get("parent_id")
    if wanted is None:
        return True
    return (project.body.get("parent_id") or project.body.get("domain_id")) == wanted


@router.post("/v3/projects")
async def create_project(request: Request) -> JSONResponse:
    return await _create(request, "project", project_view, IdentityDirectory.create_project)


@router.api_route("/v3/projects/{project_id}", methods=_GET_HEAD)
async def show_project(request: Request, project_id: str) -> JSONResponse:
    who = caller(request)
    doc = _seen(who.directory.project(project_id), who.may_see_project, "get_project")
    view = project_view(base_of(request), doc)
    params = request.query_params
    if "parents_as_ids" in params and "parents_as_list" in params:
        raise ApiError(400, "Cannot use parents_as_ids and parents_as_list at the same time.")
    if "subtree_as_ids" in params and "subtree_as_list" in params:
        raise ApiError(400, "Cannot use subtree_as_ids and subtree_as_list at the same time.")
    if "parents_as_ids" in params:
        view["parents"] = _parents_as_ids(who, doc)
    if "parents_as_list" in params:
        view["parents"] = [
            {"project": project_view(base_of(request), p)}
            for p in who.directory.parents(doc)
            if who.may_see_project(p.id)
        ]
    if "subtree_as_ids" in params:
        view["subtree"] = _subtree_as_ids(who, doc)
    if "subtree_as_list" in params:
        view["subtree"] = [
            {"project": project_view(base_of(request), p)}
            for p in who.directory.subtree(doc)
            if who.may_see_project(p.id)
        ]
    return _one("project", view)


def _parents_as_ids(who: Caller, doc: Document) -> dict[str, Any] | None:
    """{"parent": {"grandparent": {"domain": None}}}: the domain tops every chain."""
    chain = [p.id for p in who.directory.parents(doc)] + [str(doc.body.get("domain_id"))]
    nested: dict[str, Any] | None = None
    for ancestor in reversed(chain):
        nested = {ancestor: nested}
    return nested


def _subtree_as_ids(who: Caller, doc: Document) -> dict[str, Any] | None:
    children = who.directory.children(doc)
    if not children:
        return None
    return {child.id: _subtree_as_ids(who, child) for child in children}


@router.patch("/v3/projects/{project_id}")
async def update_project(request: Request, project_id: str) -> JSONResponse:
    return await _update(
        request, "project", project_id, project_view, IdentityDirectory.update_project
    )


@router.delete("/v3/projects/{project_id}")
async def delete_project(request: Request, project_id: str) -> Response:
    admin(request, "delete_project").directory.delete_project(project_id)
    return Response(status_code=204)


@router.get("/v3/projects/{project_id}/tags")
async def list_project_tags(request: Request, project_id: str) -> JSONResponse:
    who = caller(request)
    doc = _seen(who.directory.project(project_id), who.may_see_project, "list_project_tags")
    return JSONResponse({"tags": list(doc.body.get("tags", []))})


@router.put("/v3/projects/{project_id}/tags")
async def replace_project_tags(request: Request, project_id: str) -> JSONResponse:
    who = admin(request, "update_project_tags")
    body = await json_body(request)
    if not isinstance(body, dict) or "tags" not in body:
        raise ApiError(400, "Invalid input for field 'tags': required.")
    doc = who.directory.update_project(project_id, {"tags": check_tags(body["tags"])})
    return JSONResponse({"tags": doc.body["tags"]})


@router.delete("/v3/projects/{project_id}/tags")
async def clear_project_tags(request: Request, project_id: str) -> Response:
    admin(request, "delete_project_tags").directory.update_project(project_id, {"tags": []})
    return Response(status_code=204)


@router.api_route("/v3/projects/{project_id}/tags/{tag}", methods=_GET_HEAD)
async def check_project_tag(request: Request, project_id: str, tag: str) -> Response:
    who = caller(request)
    doc = _seen(who.directory.project(project_id), who.may_see_project, "get_project_tag")
    if tag not in doc.body.get("tags", []):
        raise ApiError(404, f"Could not find project tag: {tag}.")
    return Response(status_code=204)


@router.put("/v3/projects/{project_id}/tags/{tag}")
async def add_project_tag(request: Request, project_id: str, tag: str) -> Response:
    who = admin(request, "create_project_tag")
    tags = list(who.directory.project(project_id).body.get("tags", []))
    who.directory.update_project(project_id, {"tags": check_tags([*tags, tag])})
    return Response(
        status_code=201,
        headers={"Location": f"{base_of(request)}/projects/{project_id}/tags/{tag}"},
    )


@router.delete("/v3/projects/{project_id}/tags/{tag}")
async def remove_project_tag(request: Request, project_id: str, tag: str) -> Response:
    who = admin(request, "delete_project_tag")
    tags = list(who.directory.project(project_id).body.get("tags", []))
    if tag not in tags:
        raise ApiError(404, f"Could not find project tag: {tag}.")
    who.directory.update_project(project_id, {"tags": [t for t in tags if t != tag]})
    return Response(status_code=204)


# -- users ----------------------------------------------------------------------------------


@router.get("/v3/users")
async def list_users(request: Request) -> JSONResponse:
    who = caller(request)
    params = request.query_params
    if params.get("idp_id") or params.get("protocol_id") or params.get("unique_id"):
        docs: list[Document] = []  # no federated users here
    else:
        docs = [
            u
            for u in who.directory.users()
            if who.may_see_user(u.id)
            and matches_name(request, u.body.get("name", ""))
            and keep(request, u, {"domain_id": "domain_id", "enabled": "enabled"})
        ]
    return _listing(request, "users", docs, user_view)


@router.post("/v3/users")
async def create_user(request: Request) -> JSONResponse:
    return await _create(request, "user", user_view, IdentityDirectory.create_user)


@router.api_route("/v3/users/{user_id}", methods=_GET_HEAD)
async def show_user(request: Request, user_id: str) -> JSONResponse:
    who = caller(request)
    doc = _seen(who.directory.user(user_id), who.may_see_user, "get_user")
    return _one("user", user_view(base_of(request), doc))


@router.patch("/v3/users/{user_id}")
async def update_user(request: Request, user_id: str) -> JSONResponse:
    return await _update(request, "user", user_id, user_view, IdentityDirectory.update_user)


@router.delete("/v3/users/{user_id}")
async def delete_user(request: Request, user_id: str) -> Response:
    admin(request, "delete_user").directory.delete_user(user_id)
    return Response(status_code=204)


@router.post("/v3/users/{user_id}/password")
async def change_password(request: Request, user_id: str) -> Response:
    """Self-service: the original password is the credential (Keystone's change_password is
    not a policy check and needs no token, so that an expired password can be changed)."""
    fields = await envelope(request, "user")
    if "original_password" not in fields:
        raise ApiError(400, "Invalid input for field 'original_password': required.")
    # scrypt takes tens of milliseconds: off the event loop.
    await asyncio.to_thread(
        directory(request).change_password,
        user_id,
        fields["original_password"],
        fields.get("password"),
    )
    return Response(status_code=204)


# -- roles ----------------------------------------------------------------------------------


@router.get("/v3/roles")
async def list_roles(request: Request) -> JSONResponse:
    who = caller(request)
    domain_id = request.query_params.get("domain_id")
    docs = [
        r
        for r in who.directory.roles()
        if r.body.get("domain_id") == domain_id and matches_name(request, r.body.get("name", ""))
    ]
    return _listing(request, "roles", docs, role_view)


@router.post("/v3/roles")
async def create_role(request: Request) -> JSONResponse:
    return await _create(request, "role", role_view, IdentityDirectory.create_role)


@router.api_route("/v3/roles/{role_id}", methods=_GET_HEAD)
async def show_role(request: Request, role_id: str) -> JSONResponse:
    who = caller(request)
    return _one("role", role_view(base_of(request), who.directory.role(role_id)))


@router.patch("/v3/roles/{role_id}")
async def update_role(request: Request, role_id: str) -> JSONResponse:
    return await _update(request, "role", role_id, role_view, IdentityDirectory.update_role)


@router.delete("/v3/roles/{role_id}")
async def delete_role(request: Request, role_id: str) -> Response:
    admin(request, "delete_role").directory.delete_role(role_id)
    return Response(status_code=204)
