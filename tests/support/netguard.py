"""No network in the test suite: a guard on Python's socket layer.

``install()`` patches ``socket.socket.connect`` / ``connect_ex``, ``socket.getaddrinfo`` and
``socket.gethostbyname`` (which ``http.client``, ``requests`` and ``huggingface_hub`` go through): reaching
any other host raises :class:`NetworkAccessBlocked`, a UDP connect too (vLLM's address probe; the suite sets
``VLLM_HOST_IP`` instead). Loopback, this machine's host name and Unix sockets keep working (vLLM's ZMQ/IPC).

It is an ``OSError``, so libraries take their offline path; because such code may swallow it, every attempt
is also recorded (:data:`ATTEMPTS`, and the file named by ``EAGLE31_NETGUARD_LOG``, where subprocesses report),
and the suite fails at the end if any was made (``tests/conftest.py``). Subprocesses get the guard through
``tests/support/netguard_site/sitecustomize.py`` on ``PYTHONPATH``; one that cannot install it says so in the log.

Not seen: sockets opened by C/C++ code directly (ZMQ, gloo, NCCL, libcurl), ``sendto`` on an unconnected
UDP socket, ``gethostbyname_ex`` / ``gethostbyaddr``, non-Python subprocesses, and Python started with
``-I``, ``-E`` or ``-S`` (which ignore ``PYTHONPATH`` or ``sitecustomize``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

LOG_ENV = "EAGLE31_NETGUARD_LOG"
ATTEMPTS: list[str] = []


class NetworkAccessBlocked(OSError):
    """A test tried to reach another machine."""


def _ip(host):
    """``host`` as an IP address, or None for a name."""
    try:
        return ipaddress.ip_address(
            (host.decode(errors="replace") if isinstance(host, bytes) else str(host)).split("%")[0]
        )
    except ValueError:
        return None


def _is_local(host) -> bool:
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if host in (None, "", "localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", socket.gethostname()):
        return True
    address = _ip(host)  # any other host name: resolving it may already query a DNS server
    return address is not None and (address.is_loopback or address.is_unspecified)


def _refuse(what: str) -> None:
    ATTEMPTS.append(what)
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"pid {os.getpid()}: {what}\n")
    raise NetworkAccessBlocked(
        f"network access refused in the eagle31-mla tests: {what} (tests run offline; "
        "only loopback and Unix sockets are allowed)"
    )


def _check_address(sock, address) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple) and not _is_local(address[0]):
        _refuse(f"connect to {address[0]}:{address[1]}")


def is_installed() -> bool:
    return getattr(socket.socket.connect, "_eagle31_netguard", False)


def install() -> None:
    if is_installed():
        return
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex
    getaddrinfo, gethostbyname = socket.getaddrinfo, socket.gethostbyname

    def guarded_connect(self, address):
        _check_address(self, address)
        return connect(self, address)

    def guarded_connect_ex(self, address):
        _check_address(self, address)
        return connect_ex(self, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if not _is_local(host) and _ip(host) is None:  # an IP literal needs no lookup; connect() judges it
            _refuse(f"DNS lookup of {host!r}")
        return getaddrinfo(host, *args, **kwargs)

    def guarded_gethostbyname(host):
        if not _is_local(host):
            _refuse(f"DNS lookup of {host!r}")
        return gethostbyname(host)

    guarded_connect._eagle31_netguard = True
    socket.socket.connect, socket.socket.connect_ex = guarded_connect, guarded_connect_ex
    socket.getaddrinfo, socket.gethostbyname = guarded_getaddrinfo, guarded_gethostbyname


# A Python subprocess of the suite (pytest-xdist's workers too) installed the guard at start-up from this same
# file as the module "netguard" (sitecustomize); share that copy's record and error class, so that a process
# has one guard and one record whichever name imported it.
_site_copy = sys.modules.get("netguard")
if _site_copy is not None and os.path.realpath(getattr(_site_copy, "__file__", "") or "") == os.path.realpath(__file__):
    ATTEMPTS = _site_copy.ATTEMPTS
    NetworkAccessBlocked = _site_copy.NetworkAccessBlocked
