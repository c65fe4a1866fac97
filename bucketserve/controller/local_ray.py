"""The Ray a `serve` without a cluster address starts for itself: one node whose daemons,
agents and workers listen on loopback only, with Ray's token authentication on."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
AUTH_MODE = "RAY_AUTH_MODE"
# Ray waits 30 s for its GCS to bind; a busy 2-core machine can take longer
GCS_PORT_WAIT = ("RAY_gcs_server_port_wait_time_s", "180")
START_ATTEMPTS = 3


def start_local_ray(**kwargs: Any) -> None:
    """`ray.init` of a new one-node instance on loopback. `kwargs` go to `ray.init` (a
    config's `ray_init_kwargs`); the address, the node address and the dashboard are set
    here. Ray's `RAY_ADDRESS`, if set, is ignored: no cluster address means a Ray of our own."""
    _require_token_auth()
    options = {**kwargs, "_node_ip_address": LOOPBACK, "include_dashboard": False}
    with _single_node():
        init_local(**options)
    _owner_only(Path.home() / ".ray" / "auth_token")


def init_local(**options: Any) -> None:
    """`ray.init(address="local", **options)`, started again when Ray's own daemons miss
    its start-up deadlines (the raylet's 30 s cannot be raised), as on a busy 2-core
    machine."""
    import ray

    os.environ.setdefault(*GCS_PORT_WAIT)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(address="local", **options)
            return
        except Exception as exc:  # Ray raises a bare Exception or RuntimeError for these
            if "timed out" not in str(exc).lower() or attempt == START_ATTEMPTS:
                raise
            logger.warning("Ray did not start in time (%s); starting it again", exc)
            ray.shutdown()


def _owner_only(token_file: Path) -> None:
    """Ray writes its token file readable by every user of the machine; the token is the
    key to its pickled RPCs."""
    with contextlib.suppress(FileNotFoundError):
        token_file.chmod(0o600)


def _require_token_auth() -> None:
    """Token authentication for this process and the Ray it starts, whatever the
    environment says: RPCs without the token (Ray's pickled calls) are refused."""
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:  # a Ray without token authentication: loopback is all there is
        logger.warning("this Ray (%s) has no token authentication", _ray_version())
        return
    if os.environ.get(AUTH_MODE, "token").lower() != "token":
        logger.warning(
            "%s=%s ignored: the Ray that `serve` starts always requires its token",
            AUTH_MODE, os.environ[AUTH_MODE],
        )
    _enable_token_auth()  # sets RAY_AUTH_MODE=token and refreshes Ray's cached config


@contextlib.contextmanager
def _single_node() -> Iterator[None]:
    """Ray turns a loopback node address into the machine's network address so that other
    nodes can join, unless multi-node clusters are off; off, every Ray server of the node
    binds 127.0.0.1 (node-to-node traffic has no other node to reach)."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _ray_version() -> str:
    import ray

    return ray.__version__
