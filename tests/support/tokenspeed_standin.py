"""Stand-ins for the GPU that TokenSpeed's engine modules look for when they are imported (test-only).

TokenSpeed 0.1.1's registry, configs and model modules import ``tokenspeed_kernel``, which asks its platform module
for a GPU, loads native kernels linked against ``libcuda.so.1`` and asks Triton for its active driver; its
``ServerArgs`` asks ``nvidia-smi`` for the GPU's memory. :func:`install` stands in for exactly these four: TokenSpeed's
own ``Platform.override`` hook, a driver library whose every function answers CUDA_ERROR_NO_DEVICE, Triton's own
``driver.set_active``, and an ``nvidia-smi`` on ``PATH``. No TokenSpeed, Triton or plugin code is replaced; nothing
that needs a GPU can run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
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

__all__ = ["install", "driver_stand_in"]

_DRIVER_SONAME = "libcuda.so.1"
CUDA_ERROR_NO_DEVICE = 100


def _driver_functions(site: Path) -> list[str]:
    """The driver functions the native kernels that link ``libcuda.so.1`` import."""
    names = set()
    for path in site.rglob("*.so*"):
        if not path.is_file() or f"[{_DRIVER_SONAME}]" not in _run("readelf", "-d", path):
            continue
        for line in _run("nm", "-D", "--undefined-only", path).splitlines():
            name = line.split()[-1].split("@")[0]
            if re.fullmatch(r"cu[A-Z]\w*", name):  # driver API (cuInit, cuLaunchKernel...); cuda* is the runtime's
                names.add(name)
    return sorted(names)


def _run(*command) -> str:
    return subprocess.run([str(part) for part in command], capture_output=True, text=True).stdout


def driver_stand_in() -> Path:
    """The stand-in ``libcuda.so.1`` for this environment's native kernels (built once, then cached)."""
    site = Path(sysconfig.get_paths()["purelib"])
    functions = _driver_functions(site)
    key = hashlib.sha256(" ".join(functions).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"eagle31-tokenspeed-driver-stand-in-{key}"
    library = folder / _DRIVER_SONAME
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"stand_in_{os.getpid()}.c"
    # a driver with no device: every function fails with CUDA_ERROR_NO_DEVICE
    source.write_text("".join(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for name in functions))
    partial = folder / f".{_DRIVER_SONAME}.{os.getpid()}"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{_DRIVER_SONAME}", "-o", str(partial), str(source)], check=True
    )
    os.replace(partial, library)
    return library


@functools.cache  # once per process
def install() -> None:
    """Install the four stand-ins in this process; call before anything imports ``tokenspeed_kernel``."""
    if "tokenspeed_kernel" in sys.modules:
        raise RuntimeError("tokenspeed_kernel was imported before the stand-ins: call install() first")
    ctypes.CDLL(str(driver_stand_in()), mode=ctypes.RTLD_GLOBAL)  # found by soname when the kernels load

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

    tools = Path(tempfile.mkdtemp(prefix="eagle31-tokenspeed-nvidia-smi-"))
    smi = tools / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n# eagle31-mla test stand-in: the stand-in device's memory in MiB\necho {80 << 10}\n")
    smi.chmod(0o755)
    os.environ["PATH"] = f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"
