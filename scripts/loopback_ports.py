"""Loopback ports for the Python tests that start the binaries on ports
they choose (helm/test_chart.py, deploy/systemd/test_units.py).

A port from `bind(("127.0.0.1", 0))` is a random pick from the kernel's
ephemeral range (`ip_local_port_range`), and freed as soon as it is read.
So two picks of one test can be the same port (12 picks: 0.4% of tries,
measured), and another process's outgoing connection can take a picked
port before the test's process binds it. A CI run lost
`test_ha_replicas_share_etcd_as_the_chart_wires_them` to one of these: a
replica exited at start-up, before binding its web port.

`free_port` picks below the ephemeral range, where the kernel never
assigns ports on its own, checks that nothing holds the port now, and
never hands out one port twice in a process."""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()
_LOWEST = 10000  # above the registered services most machines run


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port nothing holds now, not in the kernel's
    ephemeral range when that range leaves room below it, and never
    returned before by this process."""
    low = _ephemeral_low()
    for _ in range(1000):
        if low - _LOWEST >= 1000:
            port = random.randrange(_LOWEST, low)
        else:  # the range starts low: pick inside it, as bind(0) would
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError("no free loopback port in 1000 tries")
