"""Rendezvous ports for launches on one machine (benchmarks, tests, the GPU check).

The usual trick, binding port 0 and handing on the port the kernel chose, takes the port from the
ephemeral range: the range that every outgoing connection draws its local port from. Between closing
the probe and rank 0's store binding the port, seconds of imports pass, in which any process's gloo
connections may take it; the launch then fails to bind, or its ranks reach a stranger's socket. A port
below the ephemeral range is taken only by a bind that names it, so one that is free now stays free
until its launch binds it. Ports handed out by this process are not handed out again, as a launch
may not have bound its port yet when the next asks for one.
"""

import random
import socket

_FLOOR = 10000  # below: well-known and registered services' customary ports
_GIVEN: set[int] = set()


def _ephemeral_floor() -> int:
    """The lowest port the kernel may pick for an outgoing connection."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now, outside the ephemeral range, not handed out before by this process."""
    ceiling = _ephemeral_floor()
    candidates = list(range(_FLOOR if ceiling > _FLOOR else 1024, ceiling))
    random.SystemRandom().shuffle(candidates)
    for port in candidates:
        if port not in _GIVEN and _bindable(port):
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port below the ephemeral range ({ceiling})")
