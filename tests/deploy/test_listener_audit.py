"""The start-up audit names every socket of the service's process tree listening beyond
loopback that the config did not ask for."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bucketserve.deploy.listener_audit import Listener, ListenerAudit

CHILD = """
import socket, sys
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen()
print(s.getsockname()[1], flush=True); sys.stdin.read()
"""


@pytest.fixture
def listening() -> Iterator[dict[str, int]]:
    """Ports this process listens on: one on every interface, one on loopback."""
    wide, local = socket.socket(), socket.socket()
    wide.bind(("0.0.0.0", 0))
    local.bind(("127.0.0.1", 0))
    for sock in (wide, local):
        sock.listen()
    yield {"wide": wide.getsockname()[1], "local": local.getsockname()[1]}
    wide.close()
    local.close()


def test_a_wide_listener_is_named_with_its_process_and_loopback_is_not(
    listening: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="bucketserve.deploy.listener_audit"):
        found = ListenerAudit().report(cluster=False)
    ports = {listener.port for listener in found}
    assert listening["wide"] in ports and listening["local"] not in ports
    line = next(r for r in caplog.records if f":{listening['wide']} " in r.getMessage())
    assert line.levelno == logging.WARNING and f"pid {os.getpid()}" in line.getMessage()
    assert "not asked for by the config" in line.getMessage()


def test_the_configured_ports_are_not_reported_and_a_cluster_gets_a_note(
    listening: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    assert listening["wide"] not in {
        listener.port for listener in ListenerAudit([(os.getpid(), listening["wide"])]).unexpected()
    }
    with caplog.at_level(logging.INFO, logger="bucketserve.deploy.listener_audit"):
        ListenerAudit().report(cluster=True)
    line = next(r for r in caplog.records if f":{listening['wide']} " in r.getMessage())
    assert line.levelno == logging.INFO and "keep it private" in line.getMessage()


def test_a_child_process_listener_is_found() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(child.stdout.readline())
        found = [listener for listener in ListenerAudit().unexpected() if listener.port == port]
        assert [(listener.pid, listener.host) for listener in found] == [(child.pid, "0.0.0.0")]
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False),
     ("::", False), ("192.0.2.7", False), ("::ffff:192.0.2.7", False)],
)
def test_loopback_includes_ipv4_mapped_addresses(host: str, loopback: bool) -> None:
    assert Listener(1, "p", host, 1).loopback is loopback
