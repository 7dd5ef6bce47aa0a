"""The invariants every simulated run must end with: one function per invariant, all listed
in `CHECKS`. Add one by writing a function of a `Subject` and putting it in the list.

They run once the run has settled (faults stopped, every agent up, the conductor run to
quiescence), so "terminal" means terminal: nothing may be left for a process that does not
exist.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from stowage.ledger.audit import Violation, audit
from stowage.ledger.db import READONLY
from stowage.ledger.objects import Document
from stowage.ledger.schema import consumers, hosts, pins
from stowage.services.cloud import Cloud
from stowage.services.migrations import ENDED
from stowage.services.reconcile import NOSTATE, DivergenceKind
from stowage.virt.sim import SimDriver

__all__ = ["CHECKS", "Subject", "Violation", "check_all"]

SETTLED_STATUSES = frozenset({"ACTIVE", "SHUTOFF", "ERROR", "PAUSED", "SUSPENDED"})
RUNNING = 1  # Nova's power state


@dataclass(slots=True)
class Subject:
    """What the checks look at: the ledger through a fresh process, and the hypervisors."""

    cloud: Cloud
    drivers: Mapping[str, SimDriver]
    # project id -> {"instances": n, "cores": n, "ram": n}; -1 is unlimited
    quotas: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # Unexpected exceptions the use cases raised (a 500 for an API client)
    errors: list[str] = field(default_factory=list)
    _instances: list[Document] | None = None

    def instances(self) -> list[Document]:
        if self._instances is None:
            self._instances = self.cloud.objects.list("instance")
        return self._instances


def check_audit(s: Subject) -> list[Violation]:
    """`stowage audit` is clean."""
    return audit(s.cloud.ledger)


def check_operations_terminal(s: Subject) -> list[Violation]:
    """No operation is left unfinished once the conductor ran to quiescence."""
    return [
        Violation(
            "operation.open",
            f"{op.kind} of {op.instance_id} on {op.host} still {op.state} at step {op.step} "
            f"(attempts {op.attempts}, result {op.result})",
        )
        for op in s.cloud.operations.active()
    ]


def check_migrations_ended(s: Subject) -> list[Violation]:
    """Every migration record ended (resizes waiting in VERIFY_RESIZE were confirmed or
    reverted by the settling clients)."""
    out = []
    live_ops = {op.migration_id for op in s.cloud.operations.active() if op.migration_id}
    for doc in s.cloud.objects.list("migration"):
        record = doc.body
        if record.get("status") in ENDED:
            continue
        owned = "an operation" if doc.id in live_ops else "no operation"
        out.append(
            Violation(
                "migration.open",
                f"{record.get('migration_type')} {doc.id} of {record.get('instance_uuid')} is "
                f"{record.get('status')} ({record.get('source_compute')} -> "
                f"{record.get('dest_compute')}), owned by {owned}",
            )
        )
    return out


def check_instances_settled(s: Subject) -> list[Violation]:
    """Every instance rests in a status that is not a task in progress."""
    out = []
    for doc in s.instances():
        body = doc.body
        if body.get("status") not in SETTLED_STATUSES or body.get("task_state") is not None:
            out.append(
                Violation(
                    "instance.stuck",
                    f"{doc.id} ({body.get('name')}) is {body.get('status')}/"
                    f"{body.get('task_state')} on {body.get('host')}",
                )
            )
    return out


def _consumers(s: Subject) -> list[Any]:
    with s.cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        return list(
            conn.execute(
                select(consumers.c.id, consumers.c.kind, consumers.c.instance_id, hosts.c.name)
                .select_from(consumers.outerjoin(hosts, hosts.c.id == consumers.c.host_id))
                .order_by(consumers.c.id)
            )
        )


def check_claims_match_documents(s: Subject) -> list[Violation]:
    """An instance on a host holds its claim there; every claim belongs to an instance (or a
    migration) that exists and is not over."""
    out = []
    docs = {d.id: d.body for d in s.instances()}
    migrations = {d.id: d.body for d in s.cloud.objects.list("migration")}
    held: dict[str, str | None] = {}
    for consumer_id, kind, instance_id, host in _consumers(s):
        if host is None:
            continue  # a consumer placed nowhere holds nothing
        if kind == "instance":
            held[consumer_id] = host
            if instance_id not in docs:
                out.append(
                    Violation("claim.no_instance", f"instance claim {consumer_id} on {host}")
                )
        else:
            record = migrations.get(consumer_id)
            if record is None or record.get("status") in ENDED:
                out.append(
                    Violation(
                        "claim.ended_migration",
                        f"migration claim {consumer_id} of {instance_id} on {host}, record "
                        f"{None if record is None else record.get('status')}",
                    )
                )
    for instance_id, body in sorted(docs.items()):
        host = body.get("host")
        if host and held.get(instance_id, "-") != host:
            out.append(
                Violation(
                    "instance.unclaimed",
                    f"{instance_id} is on {host} by its document, the ledger says "
                    f"{held.get(instance_id, 'nothing')}",
                )
            )
        if not host and instance_id in held:
            out.append(
                Violation(
                    "instance.claim_without_host",
                    f"{instance_id} ({body.get('status')}) has no host but holds a claim on "
                    f"{held[instance_id]}",
                )
            )
    return out


def check_quotas(s: Subject) -> list[Violation]:
    """No project has more instances, cores or RAM than its quota."""
    out = []
    used: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for doc in s.instances():
        flavor = doc.body.get("flavor") or {}
        project = str(doc.body.get("project_id"))
        used[project]["instances"] += 1
        used[project]["cores"] += int(flavor.get("vcpus", 0))
        used[project]["ram"] += int(flavor.get("ram", 0))
    for project, limits in sorted(s.quotas.items()):
        for resource, limit in sorted(limits.items()):
            have = used[project][resource]
            if limit >= 0 and have > limit:
                out.append(
                    Violation(
                        "quota.exceeded",
                        f"project {project} has {have} {resource}, quota {limit}",
                    )
                )
    return out


def check_pcpus_not_shared(s: Subject) -> list[Violation]:
    """No two guests a hypervisor runs are pinned to one pCPU."""
    out = []
    for host, driver in sorted(s.drivers.items()):
        owner: dict[int, str] = {}
        for instance_id, running in sorted(driver.running().items()):
            for cpu in sorted(set(running["pins"].values())):
                if cpu in owner:
                    out.append(
                        Violation(
                            "hypervisor.pcpu_shared",
                            f"{host} pCPU {cpu} runs {owner[cpu]} and {instance_id}",
                        )
                    )
                owner[cpu] = instance_id
    return out


def check_groups(s: Subject) -> list[Violation]:
    """Strict groups hold where the guests really run: anti-affinity members on distinct
    hosts, affinity members on one."""
    out = []
    where: dict[str, list[str]] = defaultdict(list)
    for host, driver in sorted(s.drivers.items()):
        for instance_id in sorted(driver.running()):
            where[instance_id].append(host)
    members: dict[str, list[str]] = defaultdict(list)
    for doc in s.instances():
        if doc.body.get("group_id"):
            members[str(doc.body["group_id"])].append(doc.id)
    for group_id, ids in sorted(members.items()):
        policy = s.cloud.ledger.get_group(group_id).policy.value
        hosts_of = sorted(h for iid in ids for h in where.get(iid, []))
        if policy == "anti-affinity" and len(hosts_of) != len(set(hosts_of)):
            out.append(
                Violation("hypervisor.anti_affinity", f"group {group_id} runs on {hosts_of}")
            )
        if policy == "affinity" and len(set(hosts_of)) > 1:
            out.append(Violation("hypervisor.affinity", f"group {group_id} runs on {hosts_of}"))
    return out


def _vanished(body: Mapping[str, Any]) -> bool:
    """The reconciler put the instance into Nova's state for a guest that is gone: no power
    state, not ACTIVE, with the divergence as its fault."""
    fault = body.get("fault") or {}
    return (
        body.get("power_state") == NOSTATE
        and body.get("status") != "ACTIVE"
        and fault.get("error_code") == DivergenceKind.MISSING_INSTANCE.code
    )


def check_servers_show_their_guests(s: Subject) -> list[Violation]:
    """No server shows ACTIVE (or power state Running) on a host whose hypervisor does not
    run its guest: once the reconciler passed, a vanished guest shows as Nova shows it."""
    out = []
    for doc in s.instances():
        body = doc.body
        host = body.get("host")
        driver = s.drivers.get(str(host))
        if driver is None or doc.id in driver.running():
            continue
        if body.get("status") == "ACTIVE" or body.get("power_state") == RUNNING:
            out.append(
                Violation(
                    "server.running_without_guest",
                    f"{doc.id} shows {body.get('status')}/power state "
                    f"{body.get('power_state')} on {host}, whose hypervisor does not run it",
                )
            )
    return out


def check_hypervisors_match_ledger(s: Subject) -> list[Violation]:
    """Each hypervisor runs exactly what the ledger places there, on the ledger's pCPUs; an
    instance whose guest vanished may lack it once the reconciler recorded so."""
    out = []
    vanished = {d.id for d in s.instances() if _vanished(d.body)}
    placed: dict[str, set[str]] = defaultdict(set)
    for doc in s.instances():
        if doc.body.get("host"):
            placed[str(doc.body["host"])].add(doc.id)
    with s.cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        pinned: dict[str, dict[int, int]] = defaultdict(dict)
        for consumer_id, cpu, vcpu in conn.execute(
            select(consumers.c.id, pins.c.cpu_id, pins.c.guest_vcpu)
            .select_from(pins.join(consumers, consumers.c.seq == pins.c.consumer_seq))
            .where(pins.c.guest_vcpu.is_not(None))
        ):
            pinned[consumer_id][int(vcpu)] = int(cpu)
    for host, driver in sorted(s.drivers.items()):
        running = driver.running()
        for instance_id in sorted(set(running) - placed[host]):
            out.append(
                Violation(
                    "hypervisor.unplaced_guest",
                    f"{host} runs {instance_id}, which the ledger does not place there",
                )
            )
        for instance_id in sorted(placed[host] - set(running) - vanished):
            out.append(
                Violation(
                    "hypervisor.missing_guest",
                    f"{host} does not run {instance_id}, which the ledger places there",
                )
            )
        for instance_id in sorted(placed[host] & set(running)):
            if running[instance_id]["pins"] != pinned.get(instance_id, {}):
                out.append(
                    Violation(
                        "hypervisor.pins",
                        f"{host} runs {instance_id} on {running[instance_id]['pins']}, the ledger "
                        f"pins {pinned.get(instance_id, {})}",
                    )
                )
    return out


def check_ports(s: Subject) -> list[Violation]:
    """Every port bound to a server belongs to a server that exists."""
    ids = {d.id for d in s.instances()}
    out = []
    for doc in s.cloud.objects.list("port"):
        device = doc.body.get("device_id")
        owner = str(doc.body.get("device_owner") or "")
        if device and owner.startswith("compute:") and device not in ids:
            out.append(Violation("port.orphan", f"port {doc.id} is bound to gone {device}"))
    return out


def check_images_settled(s: Subject) -> list[Violation]:
    """No image waits for data that nothing will send: once every operation is terminal, a
    snapshot's image is active, or it was killed or deleted with its failed upload."""
    return [
        Violation(
            "image.stuck",
            f"image {doc.id} ({doc.body.get('name')}) of {doc.body.get('instance_uuid')} is "
            f"{doc.body.get('status')}",
        )
        for doc in s.cloud.objects.list("image")
        if doc.body.get("status") in ("queued", "saving")
    ]


def check_no_unexpected_errors(s: Subject) -> list[Violation]:
    """A use case refuses with a domain error (a 4xx) or does its work; nothing else (a 500)."""
    return [Violation("api.unexpected_error", e) for e in s.errors]


CHECKS: list[Callable[[Subject], list[Violation]]] = [
    check_audit,
    check_operations_terminal,
    check_migrations_ended,
    check_instances_settled,
    check_claims_match_documents,
    check_quotas,
    check_pcpus_not_shared,
    check_groups,
    check_hypervisors_match_ledger,
    check_servers_show_their_guests,
    check_ports,
    check_images_settled,
    check_no_unexpected_errors,
]


def check_all(s: Subject) -> list[Violation]:
    found: list[Violation] = []
    for check in CHECKS:
        found += check(s)
    return found
