"""After start, what the service's processes (this one and every process below it: Ray's
daemons, agents and worker actors when it started Ray itself) listen on beyond loopback
that its config did not ask for: each such socket is logged, naming port and process."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket of a process of the service."""

    pid: int
    process: str
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.host.split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port} ({self.process}, pid {self.pid})"


class ListenerAudit:
    """`expected`: the (pid, port) pairs the config asked for (the gateway's ports in the
    serving process), which may listen on any address."""

    def __init__(self, expected: Iterable[tuple[int, int]] = ()) -> None:
        self.expected = set(expected)

    def unexpected(self, root_pid: int | None = None) -> list[Listener]:
        """The listeners beyond loopback in `root_pid`'s tree (default: this process's)
        that are not expected."""
        return [
            listener
            for listener in tree_listeners(root_pid or os.getpid())
            if not listener.loopback and (listener.pid, listener.port) not in self.expected
        ]

    def report(self, cluster: bool, root_pid: int | None = None) -> list[Listener]:
        """Log each unexpected listener: a warning for a Ray this service started (it needs
        nothing beyond loopback), a note for a cluster's (Ray's node-to-node ports, which
        must stay private to the cluster's network)."""
        found = self.unexpected(root_pid)
        for listener in found:
            if cluster:
                logger.info(
                    "listening beyond loopback for the Ray cluster: %s; keep it private to "
                    "the cluster's network (firewall)", listener,
                )
            else:
                logger.warning(
                    "listening beyond loopback, not asked for by the config: %s", listener
                )
        return found


def tree_listeners(root_pid: int) -> list[Listener]:
    """Every listening TCP socket of `root_pid` and the processes below it (processes that
    end or deny access meanwhile are skipped)."""
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    found = []
    for process in processes:
        try:
            connections = process.net_connections(kind="inet")
            name = _name(process)
        except psutil.Error:
            continue
        found += [
            Listener(process.pid, name, c.laddr.ip, c.laddr.port)
            for c in connections
            if c.status == psutil.CONN_LISTEN
        ]
    return found


def _name(process: psutil.Process) -> str:
    """Ray retitles its workers and agents (`ray::DecodeWorker.next_outputs`: the class is
    kept); a Python process is named by its module or script, others by their executable."""
    command = process.cmdline()
    if command and command[0].startswith("ray::"):
        return command[0].split()[0].split(".")[0]
    name = process.name()
    if name.startswith("python"):
        args = [a for a in command[1:] if not a.startswith("-") or a in ("-m", "-c")]
        if args[:1] == ["-m"] and len(args) > 1:
            return f"{name} -m {args[1]}"
        if args[:1] == ["-c"]:
            return f"{name} -c"
        if args:
            return f"{name} {os.path.basename(args[0])}"
    return name
