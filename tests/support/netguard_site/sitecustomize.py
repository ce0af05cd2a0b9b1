"""Installs the tests' network guard in every Python subprocess the test suite starts (this folder is
put on PYTHONPATH by tests/conftest.py). See tests/support/netguard.py.

A subprocess in which the guard cannot be installed is unguarded: that is recorded in the guard's log
(``EAGLE31_NETGUARD_LOG``), and the test session fails at its end (``no_network`` in conftest.py), so
the suite never runs a subprocess unguarded without saying so."""

import importlib.util
import os
import sys

_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "netguard.py")
try:
    _spec = importlib.util.spec_from_file_location("netguard", _path)
    netguard = sys.modules["netguard"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(netguard)
    netguard.install()
    if not netguard.is_installed():
        raise RuntimeError("install() returned but socket.socket.connect is not the guard")
except Exception as err:  # the subprocess still starts (its own test may say more), but the session fails
    message = f"network guard NOT installed in {' '.join(sys.argv)[:200]!r}: {type(err).__name__}: {err}"
    print(f"eagle31-mla tests: {message}", file=sys.stderr)
    _log = os.environ.get("EAGLE31_NETGUARD_LOG")
    if _log:
        with open(_log, "a") as _f:
            _f.write(f"pid {os.getpid()}: {message}\n")
