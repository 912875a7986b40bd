"""The staging pool the engine connectors share: a session on the sidecar and a shared-memory
CPU pool registered in it, through which an engine's own KV memory (which the sidecar cannot
map) is copied."""

from __future__ import annotations

from ..client import connect
from ..errors import KvtierError
from ..geometry import Geometry
from ..pool import CpuPool
from ..results import PoolHandle
from ..session import Session


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
) -> tuple[Session, CpuPool, PoolHandle]:
    """Opens a session on the sidecar at ``target``, checks that it serves ``geometry`` (the
    engine's KV shape, named ``engine_kv`` in the error), creates a pool of ``slots`` blocks
    and registers it for ``model`` on rank ``tp_rank`` of ``tp_size``. Nothing is left open
    when it fails."""
    session = connect(target, client_name, auth_token=auth_token)
    try:
        if session.geometry != geometry:
            raise KvtierError(
                f"kvtier: the sidecar serves {session.geometry}, {engine_kv} is {geometry}: "
                "configure kvtier serve's model.* settings for this model"
            )
        pool = CpuPool.create(geometry, slots)
        try:
            handle = session.register_pool(pool, model, tp_rank=tp_rank, tp_size=tp_size)
        except BaseException:
            pool.close()
            raise
    except BaseException:
        session.close()
        raise
    return session, pool, handle
