"""Installs the tests' network guard in every Python subprocess the test suite starts (this folder is
put on PYTHONPATH by tests/conftest.py). See tests/netguard.py."""

import importlib.util
import os
import sys

_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "netguard.py")
try:
    _spec = importlib.util.spec_from_file_location("netguard", _path)
    netguard = sys.modules["netguard"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(netguard)
    netguard.install()
except Exception as err:  # never break a subprocess's start-up over the guard itself
    print(f"eagle31-mla tests: network guard not installed ({err})", file=sys.stderr)
