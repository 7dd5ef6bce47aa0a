"""Role grants on projects and domains, /v3/role_assignments, and a user's projects."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.common import ApiError
from stowage.api.identity.policy import Caller, admin, caller, forbid, reader_of_all
from stowage.api.identity.views import (
    as_bool,
    base_of,
    collection,
    domain_view,
    keep,
    matches_name,
    project_view,
    role_view,
)
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services.cloud import DEFAULT_DOMAIN
from stowage.services.identity import Grant, IdentityDirectory, inference_rules
from stowage.services.identity_groups import GroupDirectory, GroupGrant
from stowage.services.identity_inherit import InheritedGrants
from stowage.services.identity_system import system_role_ids, system_roles_of

__all__ = ["router"]

router = APIRouter()

_SCOPES = {"projects": "project", "domains": "domain"}


def _scope(kind: str, target: str) -> dict[str, str | None]:
    if kind not in _SCOPES:
        raise ApiError(404, "The resource could not be found.")
    return {
        "project_id": target if kind == "projects" else None,
        "domain_id": target if kind == "domains" else None,
    }


def _must_exist(
    directory: IdentityDirectory,
    user_id: str,
    role_id: str | None,
    scope: dict[str, str | None],
    target: str,
) -> None:
    """A 404 for a missing user, role (when one is named), then project or domain."""
    directory.user(user_id)
    if role_id is not None:
        directory.role(role_id)
    if scope["project_id"] is not None:
        directory.project(target)
    else:
        directory.domain(target)


@router.put("/v3/{kind}/{target}/users/{user_id}/roles/{role_id}")
async def grant_role(
    request: Request, kind: str, target: str, user_id: str, role_id: str
) -> Response:
    scope = _scope(kind, target)
    who = admin(request, "create_grant")
    who.directory.grant(user_id, role_id, **scope)
    return Response(status_code=204)


@router.api_route("/v3/{kind}/{target}/users/{user_id}/roles/{role_id}", methods=["GET", "HEAD"])
async def check_role(
    request: Request, kind: str, target: str, user_id: str, role_id: str
) -> Response:
    scope = _scope(kind, target)
    who = caller(request)
    if not who.may_see_user(user_id):
        raise forbid("identity:check_grant")
    directory = who.directory
    _must_exist(directory, user_id, role_id, scope, target)
    if directory.find_grant(user_id, role_id, **scope) is None:
        raise ApiError(
            404,
            f"Could not find role assignment with role: {role_id}, user or group: {user_id}, "
            f"project, domain, or system: {target}.",
        )
    return Response(status_code=204)


@router.delete("/v3/{kind}/{target}/users/{user_id}/roles/{role_id}")
async def revoke_role(
    request: Request, kind: str, target: str, user_id: str, role_id: str
) -> Response:
    scope = _scope(kind, target)
    who = admin(request, "revoke_grant")
    directory = who.directory
    _must_exist(directory, user_id, role_id, scope, target)
    directory.revoke(user_id, role_id, **scope)
    return Response(status_code=204)


@router.get("/v3/{kind}/{target}/users/{user_id}/roles")
async def list_grants(request: Request, kind: str, target: str, user_id: str) -> JSONResponse:
    scope = _scope(kind, target)
    who = caller(request)
    if not who.may_see_user(user_id):
        raise forbid("identity:list_grants")
    directory = who.directory
    _must_exist(directory, user_id, None, scope, target)
    role_ids = {
        g.role_id
        for g in directory.grants(user_id=user_id, **scope)
        if g.project_id == scope["project_id"] and g.domain_id == scope["domain_id"]
    }
    docs = [r for r in directory.roles() if r.id in role_ids]
    base = base_of(request)
    path = f"{kind}/{target}/users/{user_id}/roles"
    return JSONResponse(collection(request, "roles", docs, lambda r: role_view(base, r), path=path))


# -- role assignments -----------------------------------------------------------------------


def _flag(request: Request, name: str) -> bool:
    """Keystone treats a bare `?effective` as true, and `?effective=0` as false."""
    value = request.query_params.get(name)
    return value is not None and (value == "" or as_bool(value))


@router.get("/v3/role_assignments")
async def list_role_assignments(request: Request) -> JSONResponse:
    who = caller(request)
    params = request.query_params
    user_id = params.get("user.id")
    project_id = params.get("scope.project.id")
    domain_id = params.get("scope.domain.id")
    role_id = params.get("role.id")
    effective = _flag(request, "effective")
    include_names = _flag(request, "include_names")
    include_subtree = _flag(request, "include_subtree")
    if user_id and params.get("group.id"):
        raise ApiError(400, "Specify a user or group, not both.")
    if project_id and domain_id:
        raise ApiError(400, "Specify a domain or project, not both.")
    if include_subtree and not project_id:
        raise ApiError(
            400, "scope.project.id must be specified if include_subtree is also specified."
        )
    if effective and params.get("group.id"):
        raise ApiError(
            400, "Combining effective and group filter will always result in an empty list."
        )
    directory = who.directory
    groups = GroupDirectory(directory.cloud)
    grants, group_grants, via = _collect(
        request, directory, groups, user_id, project_id, domain_id, include_subtree, effective
    )
    base = base_of(request)
    inherited_rows: list[dict[str, Any]] = []
    assignment_links: dict[str, str] = {}  # grant id -> its assignment link, when inherited
    if not params.get("scope.system"):
        inherited_rows = _inherited(
            request, directory, base, grants, via, assignment_links, effective, include_subtree
        )
    if not who.reads_all:
        grants = [g for g in grants if g.user_id == who.ctx.user_id]
        group_grants = []
        inherited_rows = [
            r for r in inherited_rows if r.get("user", {}).get("id") == who.ctx.user_id
        ]
    pairs = directory.effective(grants) if effective else ((g, None) for g in grants)
    if role_id:
        pairs = ((g, prior) for g, prior in pairs if g.role_id == role_id)
        group_grants = [g for g in group_grants if g.role_id == role_id]
    names = _Names(who) if include_names else None
    rows = [_assignment(base, g, prior, names, via, assignment_links) for g, prior in pairs]
    rows += [_group_assignment(base, g, names, groups) for g in group_grants]
    if role_id:
        inherited_rows = [r for r in inherited_rows if r["role"]["id"] == role_id]
    rows += inherited_rows
    unscoped = not (project_id or domain_id or params.get("group.id"))
    if params.get("scope.system") or (unscoped and not params.get("scope.OS-INHERIT:inherited_to")):
        rows += _system_rows(who, base, user_id, role_id, names)
    query = str(request.url.query)
    self_url = f"{base}/role_assignments" + (f"?{query}" if query else "")
    return JSONResponse(
        {"role_assignments": rows, "links": {"self": self_url, "previous": None, "next": None}}
    )


def _inherited(
    request: Request,
    directory: IdentityDirectory,
    base: str,
    grants: list[Grant],
    via: dict[str, str],
    assignment_links: dict[str, str],
    effective: bool,
    include_subtree: bool,
) -> list[dict[str, Any]]:
    """OS-INHERIT's grants: effective, one grant per project inheriting it (and per member of
    a group), added to `grants`; otherwise the rows of the grants themselves, scoped to their
    domain or project and marked inherited_to projects."""
    params = request.query_params
    user_id, group_id = params.get("user.id"), params.get("group.id")
    project_id, domain_id = params.get("scope.project.id"), params.get("scope.domain.id")
    inherited = InheritedGrants(directory.cloud)
    found = inherited.grants(role_id=None)
    if group_id:
        found = [g for g in found if g.actor == "group" and g.actor_id == group_id]
    if effective:
        if domain_id:
            return []  # an inherited grant is not held on its domain, only below it
        wanted = None
        if project_id:
            wanted = {project_id}
            if include_subtree:
                wanted |= {p.id for p in directory.subtree(directory.project(project_id))}
        for grant in found:
            users = [u for u in inherited.users_of(grant) if not user_id or u == user_id]
            if not users:
                continue
            target = (
                f"domains/{grant.domain_id}" if grant.domain_id else f"projects/{grant.project_id}"
            )
            actor = f"{grant.actor}s/{grant.actor_id}"
            assignment_links[grant.id] = (
                f"{base}/OS-INHERIT/{target}/{actor}/roles/{grant.role_id}/inherited_to_projects"
            )
            if grant.actor == "group":
                via[grant.id] = grant.actor_id
            for project in inherited.projects_of(grant):
                if wanted is not None and project.id not in wanted:
                    continue
                grants += [Grant(grant.id, u, grant.role_id, project.id, None) for u in users]
        return []
    if user_id:
        found = [g for g in found if g.actor == "user" and g.actor_id == user_id]
    if project_id:
        found = [g for g in found if g.project_id == project_id]
    elif domain_id:
        found = [g for g in found if g.domain_id == domain_id]
    rows = []
    for grant in found:
        kind, target_id = (
            ("project", grant.project_id) if grant.project_id else ("domain", grant.domain_id)
        )
        actor = f"{grant.actor}s/{grant.actor_id}"
        rows.append(
            {
                "role": {"id": grant.role_id},
                grant.actor: {"id": grant.actor_id},
                "scope": {kind: {"id": target_id}, "OS-INHERIT:inherited_to": "projects"},
                "links": {
                    "assignment": f"{base}/OS-INHERIT/{kind}s/{target_id}/{actor}/roles/"
                    f"{grant.role_id}/inherited_to_projects"
                },
            }
        )
    return rows


def _system_rows(
    who: Caller, base: str, user_id: str | None, role_id: str | None, names: _Names | None
) -> list[dict[str, Any]]:
    rows = []
    for user, role in system_role_ids(who.directory.cloud, user_id or None):
        if (role_id and role != role_id) or not (who.reads_all or user == who.ctx.user_id):
            continue
        rows.append(
            {
                "role": names.role(role) if names else {"id": role},
                "user": names.user(user) if names else {"id": user},
                "scope": {"system": {"all": True}},
                "links": {"assignment": f"{base}/system/users/{user}/roles/{role}"},
            }
        )
    return rows


def _collect(
    request: Request,
    directory: IdentityDirectory,
    groups: GroupDirectory,
    user_id: str | None,
    project_id: str | None,
    domain_id: str | None,
    include_subtree: bool,
    effective: bool,
) -> tuple[list[Grant], list[GroupGrant], dict[str, str]]:
    """The users' and groups' grants a role assignment list is about; effective, a group's
    grant becomes one per member, and `via` maps its id to the group."""
    params = request.query_params
    group_id = params.get("group.id")
    grants: list[Grant] = []
    group_grants: list[GroupGrant] = []
    via: dict[str, str] = {}  # the id of a group's grant -> the group, for effective rows
    if params.get("scope.system") or params.get("scope.OS-INHERIT:inherited_to"):
        pass  # no system grants or inherited grants here
    else:
        if not group_id:
            grants = directory.grants(user_id=user_id or None, domain_id=domain_id or None)
        if not user_id or effective:
            group_grants = groups.group_grants(
                group_id=group_id or None, domain_id=domain_id or None
            )
        if project_id:
            projects = {project_id}
            if include_subtree:
                projects |= {p.id for p in directory.subtree(directory.project(project_id))}
            grants = [g for g in grants if g.project_id in projects]
            group_grants = [g for g in group_grants if g.project_id in projects]
        elif domain_id:
            grants = [g for g in grants if g.domain_id == domain_id]
            group_grants = [g for g in group_grants if g.domain_id == domain_id]
        if effective:
            # Effective: a group's grant is one per member (Keystone's membership links).
            for gg in group_grants:
                via[gg.id] = gg.group_id
                for member in groups.member_ids(gg.group_id):
                    if not user_id or member == user_id:
                        grants.append(Grant(gg.id, member, gg.role_id, gg.project_id, gg.domain_id))
            group_grants = []
    return grants, group_grants, via


class _Names:
    """Names for include_names, looked up once per request."""

    def __init__(self, who: Caller) -> None:
        directory = who.directory
        self.domains = {d.id: d for d in directory.domains()}
        self.projects = {p.id: p for p in directory.projects()}
        self.users = {u.id: u for u in directory.users()}
        self.roles = {r.id: r for r in directory.roles()}

    def domain(self, domain_id: str | None) -> dict[str, Any]:
        doc = self.domains.get(domain_id or "")
        return {"id": domain_id, "name": doc.name if doc is not None else ""}

    def _owned(self, doc: Document | None, id: str) -> dict[str, Any]:
        if doc is None:
            return {"id": id, "name": "", "domain": self.domain(DEFAULT_DOMAIN)}
        return {
            "id": id,
            "name": doc.name,
            "domain": self.domain(str(doc.body.get("domain_id", DEFAULT_DOMAIN))),
        }

    def user(self, user_id: str) -> dict[str, Any]:
        return self._owned(self.users.get(user_id), user_id)

    def project(self, project_id: str) -> dict[str, Any]:
        return self._owned(self.projects.get(project_id), project_id)

    def role(self, role_id: str) -> dict[str, Any]:
        doc = self.roles.get(role_id)
        out: dict[str, Any] = {"id": role_id, "name": doc.name if doc is not None else ""}
        if doc is not None and doc.body.get("domain_id"):
            out["domain"] = self.domain(doc.body["domain_id"])
        return out


def _target(grant: Grant | GroupGrant, names: _Names | None) -> tuple[str, dict[str, Any]]:
    if grant.project_id is not None:
        target = f"projects/{grant.project_id}"
        scope = {"project": names.project(grant.project_id) if names else {"id": grant.project_id}}
    else:
        target = f"domains/{grant.domain_id}"
        scope = {"domain": names.domain(grant.domain_id) if names else {"id": grant.domain_id}}
    return target, scope


def _group_assignment(
    base: str, grant: GroupGrant, names: _Names | None, groups: GroupDirectory
) -> dict[str, Any]:
    target, scope = _target(grant, names)
    group: dict[str, Any] = {"id": grant.group_id}
    if names is not None:
        doc = groups.objects.find("group", grant.group_id)
        group.update(
            name=doc.name if doc is not None else "",
            domain=names.domain(str(doc.body.get("domain_id")) if doc is not None else None),
        )
    return {
        "role": names.role(grant.role_id) if names else {"id": grant.role_id},
        "group": group,
        "scope": scope,
        "links": {"assignment": f"{base}/{target}/groups/{grant.group_id}/roles/{grant.role_id}"},
    }


def _assignment(
    base: str,
    grant: Grant,
    prior: Grant | None,
    names: _Names | None,
    via: dict[str, str] | None = None,
    assignment_links: dict[str, str] | None = None,
) -> dict[str, Any]:
    origin = prior or grant
    target, scope = _target(grant, names)
    group_id = (via or {}).get(origin.id)
    inherited = (assignment_links or {}).get(origin.id)
    if group_id is not None:
        links = {
            "assignment": inherited or f"{base}/{target}/groups/{group_id}/roles/{origin.role_id}",
            "membership": f"{base}/groups/{group_id}/users/{origin.user_id}",
        }
    else:
        links = {
            "assignment": inherited
            or f"{base}/{target}/users/{origin.user_id}/roles/{origin.role_id}"
        }
    if prior is not None:
        links["prior_role"] = f"{base}/roles/{prior.role_id}"
    return {
        "role": names.role(grant.role_id) if names else {"id": grant.role_id},
        "user": names.user(grant.user_id) if names else {"id": grant.user_id},
        "scope": scope,
        "links": links,
    }


# -- implied roles (role inference rules) ---------------------------------------------------


def _brief(base: str, doc: Document) -> dict[str, Any]:
    return {"id": doc.id, "name": doc.name, "links": {"self": f"{base}/roles/{doc.id}"}}


def _inference(request: Request, prior: Document, implied: Document) -> dict[str, Any]:
    base = base_of(request)
    return {
        "role_inference": {"prior_role": _brief(base, prior), "implies": _brief(base, implied)},
        "links": {"self": f"{base}/roles/{prior.id}/implies/{implied.id}"},
    }


@router.put("/v3/roles/{prior_id}/implies/{implied_id}")
async def create_implied_role(request: Request, prior_id: str, implied_id: str) -> JSONResponse:
    who = admin(request, "create_implied_role")
    prior, implied = who.directory.create_implied_role(prior_id, implied_id)
    return JSONResponse(_inference(request, prior, implied), status_code=201)


@router.get("/v3/roles/{prior_id}/implies/{implied_id}")
async def show_implied_role(request: Request, prior_id: str, implied_id: str) -> JSONResponse:
    who = reader_of_all(request, "get_implied_role")
    prior, implied = who.directory.implied_rule(prior_id, implied_id)
    return JSONResponse(_inference(request, prior, implied))


@router.head("/v3/roles/{prior_id}/implies/{implied_id}")
async def check_implied_role(request: Request, prior_id: str, implied_id: str) -> Response:
    reader_of_all(request, "check_implied_role").directory.implied_rule(prior_id, implied_id)
    return Response(status_code=204)


@router.delete("/v3/roles/{prior_id}/implies/{implied_id}")
async def delete_implied_role(request: Request, prior_id: str, implied_id: str) -> Response:
    admin(request, "delete_implied_role").directory.delete_implied_role(prior_id, implied_id)
    return Response(status_code=204)


@router.get("/v3/roles/{prior_id}/implies")
async def list_implied_roles(request: Request, prior_id: str) -> JSONResponse:
    who = reader_of_all(request, "list_implied_roles")
    prior, implied = who.directory.implied_by(prior_id)
    base = base_of(request)
    return JSONResponse(
        {
            "role_inference": {
                "prior_role": _brief(base, prior),
                "implies": [_brief(base, d) for d in implied],
            },
            "links": {"self": f"{base}/roles/{prior.id}/implies"},
        }
    )


@router.get("/v3/role_inferences")
async def list_role_inferences(request: Request) -> JSONResponse:
    who = reader_of_all(request, "list_role_inference_rules")
    base = base_of(request)
    roles = {r.id: r for r in who.directory.roles()}
    implies: dict[str, list[Document]] = {}
    for prior, implied in inference_rules(who.directory.cloud, roles.values()):
        if prior in roles and implied in roles:
            implies.setdefault(prior, []).append(roles[implied])
    rows = [
        {"prior_role": _brief(base, roles[prior]), "implies": [_brief(base, d) for d in docs]}
        for prior, docs in implies.items()
    ]
    return JSONResponse({"role_inferences": rows, "links": {"self": f"{base}/role_inferences"}})


# -- a user's projects ----------------------------------------------------------------------


def _projects_page(request: Request, path: str, docs: list[Document]) -> JSONResponse:
    base = base_of(request)
    kept = [
        p
        for p in docs
        if matches_name(request, p.body.get("name", ""))
        and keep(request, p, {"domain_id": "domain_id", "enabled": "enabled"})
    ]
    page = collection(request, "projects", kept, lambda p: project_view(base, p), path=path)
    return JSONResponse(page)


@router.get("/v3/users/{user_id}/projects")
async def list_user_projects(request: Request, user_id: str) -> JSONResponse:
    who = caller(request)
    who.directory.user(user_id)
    if not who.may_see_user(user_id):
        raise forbid("identity:list_user_projects")
    return _projects_page(request, f"users/{user_id}/projects", who.directory.projects_of(user_id))


@router.get("/v3/auth/projects")
async def list_auth_projects(request: Request) -> JSONResponse:
    """The projects the token's user may scope a token to: enabled ones in enabled domains."""
    who = caller(request)
    docs = who.directory.projects_of(who.ctx.user_id, enabled_only=True)
    return _projects_page(request, "auth/projects", docs)


@router.get("/v3/auth/domains")
async def list_auth_domains(request: Request) -> JSONResponse:
    who = caller(request)
    base = base_of(request)
    docs = GroupDirectory(who.directory.cloud).domains_of(who.ctx.user_id)
    page = collection(request, "domains", docs, lambda d: domain_view(base, d), path="auth/domains")
    return JSONResponse(page)


@router.get("/v3/auth/system")
async def list_auth_system(request: Request) -> JSONResponse:
    who = caller(request)
    held = system_roles_of(who.directory.cloud, who.ctx.user_id)  # its own and its groups'
    system = [{"all": True}] if held else []
    return JSONResponse({"system": system, "links": {"self": f"{base_of(request)}/auth/system"}})
