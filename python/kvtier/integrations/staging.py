"""The session an engine connector opens, and the staging pool the connectors share: a
shared-memory CPU pool registered in the session, through which an engine's own KV memory is
copied when the sidecar cannot reach it where it lies (see :mod:`kvtier.integrations.in_place`)."""

from __future__ import annotations

from ..client import connect
from ..errors import KvtierError
from ..geometry import Geometry
from ..pool import CpuPool
from ..results import PoolHandle
from ..session import Session


def open_session(target: str | None, client_name: str, *, auth_token: str | None, geometry: Geometry,
                 engine_kv: str, watch_removals: bool = False, connect_timeout: float = 10.0) -> Session:
    """Opens a session on the sidecar at ``target`` (waiting at most ``connect_timeout`` seconds
    to reach it) and checks that it serves ``geometry`` (the engine's KV shape, named
    ``engine_kv`` in the error); closed again when it does not."""
    session = connect(target, client_name, auth_token=auth_token, watch_removals=watch_removals,
                      connect_timeout=connect_timeout)
    if session.geometry != geometry:
        session.close()
        raise KvtierError(
            f"kvtier: the sidecar serves {session.geometry}, {engine_kv} is {geometry}: "
            "configure kvtier serve's model.* settings for this model"
        )
    return session


def add_staging_pool(session: Session, *, slots: int, model: str, tp_rank: int,
                     tp_size: int) -> tuple[CpuPool, PoolHandle]:
    """Creates a pool of ``slots`` blocks of the session's geometry and registers it for
    ``model`` on rank ``tp_rank`` of ``tp_size`` (the file is removed again when that fails)."""
    pool = CpuPool.create(session.geometry, slots)
    try:
        return pool, session.register_pool(pool, model, tp_rank=tp_rank, tp_size=tp_size)
    except BaseException:
        pool.close()
        raise


def open_staging(
    target: str | None,
    client_name: str,
    *,
    auth_token: str | None,
    geometry: Geometry,
    slots: int,
    model: str,
    tp_rank: int,
    tp_size: int,
    engine_kv: str,
    watch_removals: bool = False,
    connect_timeout: float = 10.0,
) -> tuple[Session, CpuPool, PoolHandle]:
    """:func:`open_session` and :func:`add_staging_pool`. Nothing is left open when it fails."""
    session = open_session(target, client_name, auth_token=auth_token, geometry=geometry, engine_kv=engine_kv,
                           watch_removals=watch_removals, connect_timeout=connect_timeout)
    try:
        pool, handle = add_staging_pool(session, slots=slots, model=model, tp_rank=tp_rank, tp_size=tp_size)
    except BaseException:
        session.close()
        raise
    return session, pool, handle
