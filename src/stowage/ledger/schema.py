"""The ledger's tables. Invariants live in keys and checks, so a bug elsewhere fails a commit."""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    literal_column,
    or_,
    select,
    text,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import ScalarSelect

__all__ = [
    "allocations",
    "cells",
    "changes",
    "consumer_key",
    "consumers",
    "consumers_of_instance",
    "group_members",
    "group_slots",
    "host_generations",
    "hosts",
    "hosts_and_generations",
    "inventories",
    "metadata",
    "numa_claims",
    "objects",
    "operations",
    "pcpus",
    "pins",
    "server_groups",
    "storage_pools",
    "volume_claims",
]

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

hosts = Table(
    "hosts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("uuid", String(36), nullable=False, unique=True),
    Column("name", String(255), nullable=False, unique=True),
    Column("availability_zone", String(255), nullable=False, default="nova"),
    Column("labels", Text, nullable=False, default="{}"),  # JSON object of str -> str
    # JSON object of key -> sorted values: the metadata of every aggregate the host is in,
    # synced by the compute API so the scheduler reads it with the host (one change row).
    Column("aggregate_metadata", Text, nullable=False, server_default="{}"),
    Column("hypervisor_type", String(64), nullable=False, default="sim"),
    Column("architecture", String(32), nullable=False, default="x86_64"),
    Column("topology", Text, nullable=False),  # JSON: cells, siblings, CPU sets
    Column("disabled", Boolean, nullable=False, default=False),
    Column("forced_down", Boolean, nullable=False, default=False),
    Column("last_seen", Float, nullable=True),  # heartbeat time, seconds since the epoch
    # Every scheduler reads every host's liveness every few seconds (`Views.refresh_liveness`):
    # from this index alone SQLite scans a few pages instead of the rows and their topology.
    Index("ix_hosts_liveness", "last_seen", "forced_down", "disabled"),
)

# Each host's generation, bumped by every claim and release that touches the host: Placement's
# provider generation, and the row every writer locks first, in id order, so writers never
# deadlock. A narrow table of its own: every claim writes the page of its host's row, and in
# `hosts` that row also held the topology (43 of the 159 pages a batch of 256 claims wrote at
# 10,000 hosts; here a page holds about a thousand hosts' rows).
host_generations = Table(
    "host_generations",
    metadata,
    Column("host_id", Integer, ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True),
    Column("generation", Integer, nullable=False, default=0),
)

# Each host's row with its generation, for the readers that want both.
hosts_and_generations = hosts.join(host_generations, host_generations.c.host_id == hosts.c.id)

cells = Table(
    "cells",
    metadata,
    Column("host_id", Integer, ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
    Column("cell_id", Integer, nullable=False),
    Column("memory_mb", Integer, nullable=False),
    Column("memory_mb_used", Integer, nullable=False, default=0),
    PrimaryKeyConstraint("host_id", "cell_id"),
    CheckConstraint("memory_mb_used >= 0 AND memory_mb_used <= memory_mb", name="ck_cells_memory"),
)

pcpus = Table(
    "pcpus",
    metadata,
    Column("host_id", Integer, nullable=False),
    Column("cpu_id", Integer, nullable=False),
    Column("cell_id", Integer, nullable=False),
    Column("dedicated", Boolean, nullable=False),
    PrimaryKeyConstraint("host_id", "cpu_id"),
    # The target of pins' foreign key: only a dedicated pCPU can be pinned.
    UniqueConstraint("host_id", "cpu_id", "dedicated", name="uq_pcpus_pinnable"),
    ForeignKeyConstraint(["host_id", "cell_id"], ["cells.host_id", "cells.cell_id"]),
)

inventories = Table(
    "inventories",
    metadata,
    Column("host_id", Integer, ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
    Column("resource_class", String(64), nullable=False),
    Column("total", Integer, nullable=False),
    Column("reserved", Integer, nullable=False, default=0),
    Column("allocation_ratio", Float, nullable=False, default=1.0),
    Column("min_unit", Integer, nullable=False, default=1),
    Column("max_unit", Integer, nullable=False),
    Column("step_size", Integer, nullable=False, default=1),
    Column("used", Integer, nullable=False, default=0),
    PrimaryKeyConstraint("host_id", "resource_class"),
    CheckConstraint(
        "used >= 0 AND used <= (total - reserved) * allocation_ratio",
        name="ck_inventories_capacity",
    ),
)

# A consumer is named by the API's UUID (`id`) and keyed by `seq`, assigned in insert order:
# the claim tables reference `seq`, so a batch of new claims appends to the last pages of
# their keys and indexes instead of landing one random page a claim (each page a WAL frame).
# A literal, not a bound parameter: a query's term must match the partial index's own for
# SQLite, and for PostgreSQL's generic plans, to use it.
_MIGRATION = "kind = 'migration'"

consumers = Table(
    "consumers",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("id", String(36), nullable=False, unique=True),
    Column("kind", String(16), nullable=False),  # instance | migration
    # An instance's own consumer has its instance's id as `id` (Claims.claim refuses any
    # other), so only a move's consumer needs `instance_id` indexed: an index of every row
    # took a random page per claim (at 1,000,000 instances, 40% of the WAL frames a batch
    # of claims wrote). `consumers_of_instance` reads both halves through their indexes.
    Column("instance_id", String(36), nullable=False),  # itself, or the migrating instance
    Column("project_id", String(64), nullable=False, default=""),
    Column("user_id", String(64), nullable=False, default=""),
    Column("host_id", Integer, ForeignKey("hosts.id"), nullable=True),
    Column("generation", Integer, nullable=False, default=0),
    Column("created_at", Float, nullable=False),
    CheckConstraint("kind IN ('instance', 'migration')", name="ck_consumers_kind"),
    Index(
        "ix_consumers_migration_instance_id",
        "instance_id",
        sqlite_where=text(_MIGRATION),
        postgresql_where=text(_MIGRATION),
    ),
    Index("ix_consumers_host_id", "host_id"),
)


def consumers_of_instance(instance_id: ColumnElement[str] | str) -> ColumnElement[bool]:
    """The `consumers` rows of an instance, those `consumers.instance_id == instance_id`
    selects (the instance's own and its moves'), in two halves that each have an index: the
    own row by its unique `id`, the moves' by the partial index of migrations."""
    kind = consumers.c.kind
    return or_(
        and_(consumers.c.id == instance_id, kind == literal_column("'instance'")),
        and_(kind == literal_column("'migration'"), consumers.c.instance_id == instance_id),
    )


def consumer_key(consumer_id: str) -> ScalarSelect[int]:
    """The `seq` of the consumer named `consumer_id`, to match a claim table's `consumer_seq`
    against in one statement (NULL, so no match, if there is no such consumer)."""
    return select(consumers.c.seq).where(consumers.c.id == consumer_id).scalar_subquery()


allocations = Table(
    "allocations",
    metadata,
    Column("consumer_seq", Integer, ForeignKey("consumers.seq"), nullable=False),
    Column("host_id", Integer, nullable=False),
    Column("resource_class", String(64), nullable=False),
    Column("amount", Integer, nullable=False),
    # No foreign key to inventories: the claim's guarded update of (host, class) must touch
    # exactly one row per allocation or the claim is refused, which checks the same thing
    # without a per-row trigger on the hot path.
    PrimaryKeyConstraint("consumer_seq", "host_id", "resource_class"),
    CheckConstraint("amount > 0", name="ck_allocations_amount"),
    Index("ix_allocations_host_id", "host_id"),
)

numa_claims = Table(
    "numa_claims",
    metadata,
    Column("consumer_seq", Integer, ForeignKey("consumers.seq"), nullable=False),
    Column("host_id", Integer, nullable=False),
    Column("cell_id", Integer, nullable=False),
    Column("guest_cell", Integer, nullable=False),
    Column("memory_mb", Integer, nullable=False),
    # Likewise the cell's guarded memory update must touch exactly one row per cell claimed.
    PrimaryKeyConstraint("consumer_seq", "host_id", "cell_id"),
    Index("ix_numa_claims_host_id", "host_id"),
)

pins = Table(
    "pins",
    metadata,
    Column("host_id", Integer, nullable=False),
    Column("cpu_id", Integer, nullable=False),
    Column("consumer_seq", Integer, ForeignKey("consumers.seq"), nullable=False),
    Column("guest_vcpu", Integer, nullable=True),  # NULL: a sibling withheld by isolate
    Column("dedicated", Boolean, nullable=False, default=True),
    # One row per pCPU: a double pin is a duplicate key, whoever writes it.
    PrimaryKeyConstraint("host_id", "cpu_id"),
    ForeignKeyConstraint(
        ["host_id", "cpu_id", "dedicated"],
        ["pcpus.host_id", "pcpus.cpu_id", "pcpus.dedicated"],
    ),
    CheckConstraint("dedicated", name="ck_pins_dedicated"),
    Index("ix_pins_consumer_seq", "consumer_seq"),
)

server_groups = Table(
    "server_groups",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("name", String(255), nullable=False),
    Column("policy", String(32), nullable=False),
    Column("max_per_domain", Integer, nullable=False, default=1),
    Column("failure_domain", String(64), nullable=False, default="host"),
    Column("rules", Text, nullable=False, default="{}"),
    Column("project_id", String(64), nullable=False, default=""),
    Column("user_id", String(64), nullable=False, default=""),
    Column("created_at", Float, nullable=False),
    CheckConstraint("max_per_domain >= 1", name="ck_server_groups_max"),
)

group_members = Table(
    "group_members",
    metadata,
    Column(
        "group_id", String(36), ForeignKey("server_groups.id", ondelete="CASCADE"), nullable=False
    ),
    Column("instance_id", String(36), nullable=False),
    PrimaryKeyConstraint("group_id", "instance_id"),
    Index("ix_group_members_instance_id", "instance_id"),
)

group_slots = Table(
    "group_slots",
    metadata,
    Column("group_id", String(36), ForeignKey("server_groups.id"), nullable=False),
    Column("domain", String(255), nullable=False),  # "host=h1" or "rack=r3"
    Column("slot", Integer, nullable=False),
    Column("max_per_domain", Integer, nullable=False),
    Column("consumer_seq", Integer, ForeignKey("consumers.seq"), nullable=False),
    Column("host_id", Integer, ForeignKey("hosts.id"), nullable=False),
    # Strict anti-affinity as keys: a domain has slots 0..max-1 and each is held once,
    # so one member too many is a duplicate key or a failed check, never a violation.
    PrimaryKeyConstraint("group_id", "domain", "slot"),
    UniqueConstraint("group_id", "consumer_seq", name="uq_group_slots_consumer"),
    CheckConstraint("slot >= 0 AND slot < max_per_domain", name="ck_group_slots_slot"),
    Index("ix_group_slots_host_id", "host_id"),
    Index("ix_group_slots_consumer_seq", "consumer_seq"),
)

# Which hosts changed, in commit order as seen by readers: schedulers refresh their view
# from here instead of rescanning every host.
changes = Table(
    "changes",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("host_id", Integer, nullable=False),
    Column("at", Float, nullable=False),
    # The scheduler whose view already holds this change; it skips its own rows on refresh.
    Column("writer", String(36), nullable=True),
)

# API-level resources (identity, flavors, images, networks, instances' descriptions, ...) as
# JSON documents keyed by kind and id. What a claim owns never lives here: that is the
# tables above. Name, project and ref are columns so lists can filter and page on them.
objects = Table(
    "objects",
    metadata,
    Column("kind", String(32), nullable=False),
    Column("id", String(255), nullable=False),  # Nova's flavor ids go up to 255
    Column("project_id", String(64), nullable=True),
    Column("name", String(255), nullable=True),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("body", Text, nullable=False),
    # What a document of some kinds refers to, so that its holder's are found by an index
    # (`ObjectStore.REFS`: a port's device): written by the store from the body, never by
    # callers.
    Column("ref", String(255), nullable=True),
    PrimaryKeyConstraint("kind", "id"),
    Index("ix_objects_kind_name", "kind", "name"),
    Index("ix_objects_kind_ref", "kind", "ref"),
    Index("ix_objects_kind_project", "kind", "project_id"),
    Index("ix_objects_kind_created", "kind", "created_at", "id"),
)

# The conductor's durable work: one row per long operation (a build, a power action, a move,
# a snapshot, a clean-up on a host). A step's agent call is keyed by "<id>:<step>", so a
# resumed or redelivered step is recognised by the agent. `owner`/`lease_until` let several
# conductors share the table; a crashed conductor's lease runs out and another resumes.
operations = Table(
    "operations",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("kind", String(32), nullable=False),
    Column("instance_id", String(64), nullable=False),
    Column("host", String(255), nullable=False),  # the agent the next step talks to
    Column("migration_id", String(64), nullable=True),
    Column("state", String(16), nullable=False),  # pending, unknown, done, failed
    Column("step", String(32), nullable=False),
    Column("payload", Text, nullable=False),
    Column("result", Text, nullable=True),
    Column("attempts", Integer, nullable=False, default=0),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("next_at", Float, nullable=False),
    Column("owner", String(64), nullable=True),
    Column("lease_until", Float, nullable=True),
    CheckConstraint(
        "state IN ('pending', 'unknown', 'done', 'failed')", name="ck_operations_state"
    ),
    Index("ix_operations_state_next", "state", "next_at"),
    Index("ix_operations_instance", "instance_id"),
)

# Block storage: a pool of a volume backend (a local-file directory, later LVM or RBD) with
# its capacity in GiB, and one claim per volume or snapshot that takes gigabytes from it. As
# the hosts' inventories: usage moves by a guarded `used_gb = used_gb + n`, and the CHECK
# refuses an overcommit whoever writes it.
storage_pools = Table(
    "storage_pools",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(255), nullable=False, unique=True),
    Column("backend", String(32), nullable=False),  # local-file
    Column("total_gb", Integer, nullable=False),
    Column("reserved_gb", Integer, nullable=False, default=0),
    Column("allocation_ratio", Float, nullable=False, default=1.0),
    Column("used_gb", Integer, nullable=False, default=0),
    CheckConstraint(
        "used_gb >= 0 AND used_gb <= (total_gb - reserved_gb) * allocation_ratio",
        name="ck_storage_pools_capacity",
    ),
)

volume_claims = Table(
    "volume_claims",
    metadata,
    Column("consumer_id", String(36), primary_key=True),  # the volume's or snapshot's id
    Column("kind", String(16), nullable=False),
    Column("pool_id", Integer, ForeignKey("storage_pools.id"), nullable=False),
    Column("project_id", String(64), nullable=False),
    Column("gigabytes", Integer, nullable=False),
    CheckConstraint("gigabytes > 0", name="ck_volume_claims_gigabytes"),
    CheckConstraint("kind IN ('volume', 'snapshot')", name="ck_volume_claims_kind"),
    Index("ix_volume_claims_pool_id", "pool_id"),
)
