"""Stand-ins for the GPU that TokenSpeed 0.1.1's engine modules probe for when imported (test-only): its own
``Platform.override``, a ``libcuda.so.1`` whose every function answers CUDA_ERROR_NO_DEVICE, Triton's own
``driver.set_active`` and an ``nvidia-smi`` on ``PATH`` (docs/engines.md). No TokenSpeed, Triton or plugin code is
replaced; nothing that needs a GPU can run.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import types
from pathlib import Path

_DRIVER_SONAME = "libcuda.so.1"
CUDA_ERROR_NO_DEVICE = 100


def _run(*command) -> str:
    return subprocess.run([str(part) for part in command], capture_output=True, text=True).stdout


def driver_stand_in(folder: Path) -> Path:
    """A ``libcuda.so.1`` in ``folder`` with every driver function this environment's native kernels import."""
    functions = set()
    for path in Path(sysconfig.get_paths()["purelib"]).rglob("*.so*"):
        if not path.is_file() or f"[{_DRIVER_SONAME}]" not in _run("readelf", "-d", path):
            continue
        for line in _run("nm", "-D", "--undefined-only", path).splitlines():
            name = line.split()[-1].split("@")[0]
            if re.fullmatch(r"cu[A-Z]\w*", name):  # driver API (cuInit, cuLaunchKernel...); cuda* is the runtime's
                functions.add(name)
    source, library = folder / "driver_stand_in.c", folder / _DRIVER_SONAME
    source.write_text("".join(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for name in sorted(functions)))
    command = ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{_DRIVER_SONAME}", "-o", str(library), str(source)]
    subprocess.run(command, check=True)
    return library


@functools.cache  # once per process
def install() -> None:
    """Install the four stand-ins in this process; call before anything imports ``tokenspeed_kernel``."""
    if "tokenspeed_kernel" in sys.modules:
        raise RuntimeError("tokenspeed_kernel was imported before the stand-ins: call install() first")
    tools = Path(tempfile.mkdtemp(prefix="eagle31-tokenspeed-stand-ins-"))
    ctypes.CDLL(str(driver_stand_in(tools)), mode=ctypes.RTLD_GLOBAL)  # found by soname when the kernels load

    # The platform module alone, without the package __init__ (which probes the platform at once).
    spec = importlib.util.find_spec("tokenspeed_kernel")
    package = types.ModuleType("tokenspeed_kernel")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["tokenspeed_kernel"] = package
    try:
        platform = importlib.import_module("tokenspeed_kernel.platform")
    finally:
        del sys.modules["tokenspeed_kernel"]
    h100 = dict(vendor="nvidia", arch_version=platform.ArchVersion(9, 0), device_count=1, total_memory=80 << 30)
    h100 |= dict(memory_bandwidth=3350.0, sm_count=132, max_threads_per_sm=2048, max_shared_memory_per_sm=228 << 10)
    platform.Platform.override(platform.PlatformInfo(device_name="eagle31-mla test stand-in (no GPU)", **h100))

    from tokenspeed_triton.backends.compiler import GPUTarget
    from tokenspeed_triton.runtime.driver import driver

    class NoDeviceTritonDriver:
        """Names a CUDA target (what the kernel modules ask at import); compiles and launches nothing."""

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def __getattr__(self, name):
            raise RuntimeError(f"the test stand-in Triton driver cannot {name}: there is no GPU")

    driver.set_active(NoDeviceTritonDriver())
    importlib.import_module("tokenspeed_kernel")

    smi = tools / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n# eagle31-mla test stand-in: the stand-in device's memory in MiB\necho {80 << 10}\n")
    smi.chmod(0o755)
    os.environ["PATH"] = f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"
