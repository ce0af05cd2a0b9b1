"""Stand-ins for the GPU that TokenSpeed's engine modules look for when they are imported (test-only).

``import tokenspeed`` and its plugin loader work without a GPU, but TokenSpeed 0.1.1's registry, configs and
model modules import ``tokenspeed_kernel``, which

1. asks ``tokenspeed_kernel.platform`` for an NVIDIA, AMD or Ascend device, and raises without one;
2. loads native kernels linked against the NVIDIA driver library (``libcuda.so.1``), absent here;
3. asks Triton for its active GPU driver, and raises without one;

and its ``ServerArgs`` asks ``nvidia-smi`` for the GPU's memory. :func:`install` stands in for exactly these
four, and for nothing else:

1. ``Platform.override(...)``, TokenSpeed's own hook "for testing/debugging", set before the kernel
   package's ``__init__`` first probes the platform (an H100-like NVIDIA description);
2. a driver library whose every function answers CUDA_ERROR_NO_DEVICE, built with the C compiler from the
   driver functions those native kernels import: they load, and nothing can run on them;
3. Triton's own ``driver.set_active(...)`` with a driver that names a CUDA target and does nothing else;
4. an ``nvidia-smi`` first on ``PATH`` that answers the memory query with the stand-in device's 80 GiB.

No TokenSpeed, Triton or plugin code is replaced, and the plugin ships none of this. Nothing that needs a
GPU can run: the tests stop at what TokenSpeed does before it touches one (plugin loading, registries,
configs, model profiles, the target classes' id setters, the source of the Kimi-K3 capture).
"""

from __future__ import annotations

import ctypes
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
_installed = False


def _libraries_needing_the_driver(site: Path) -> list[Path]:
    found = []
    for path in site.rglob("*.so*"):
        if not path.is_file() or ".so" not in path.name:
            continue
        dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
        if f"[{_DRIVER_SONAME}]" in dynamic:
            found.append(path)
    return found


def _driver_functions(libraries: list[Path]) -> list[str]:
    names = set()
    for path in libraries:
        undefined = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True).stdout
        for line in undefined.splitlines():
            name = line.split()[-1].split("@")[0]
            if re.fullmatch(r"cu[A-Z]\w*", name):  # driver API (cuInit, cuLaunchKernel...); cuda* is the runtime's
                names.add(name)
    return sorted(names)


def driver_stand_in() -> Path:
    """The stand-in ``libcuda.so.1`` for this environment's native kernels (built once, then cached)."""
    site = Path(sysconfig.get_paths()["purelib"])
    functions = _driver_functions(_libraries_needing_the_driver(site))
    key = hashlib.sha256(" ".join(functions).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"eagle31-tokenspeed-driver-stand-in-{key}"
    library = folder / _DRIVER_SONAME
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"stand_in_{os.getpid()}.c"
    source.write_text(
        "/* A driver with no device: every function fails with CUDA_ERROR_NO_DEVICE. */\n"
        + "".join(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for name in functions)
    )
    partial = folder / f".{_DRIVER_SONAME}.{os.getpid()}"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{_DRIVER_SONAME}", "-o", str(partial), str(source)], check=True
    )
    os.replace(partial, library)
    return library


def install() -> None:
    """Install the three stand-ins in this process; call before anything imports ``tokenspeed_kernel``."""
    global _installed
    if _installed:
        return
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
    platform.Platform.override(
        platform.PlatformInfo(
            vendor="nvidia",
            arch_version=platform.ArchVersion(9, 0),
            device_name="eagle31-mla test stand-in (no GPU)",
            device_count=1,
            total_memory=80 << 30,
            memory_bandwidth=3350.0,
            sm_count=132,
            max_threads_per_sm=2048,
            max_shared_memory_per_sm=228 << 10,
        )
    )

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
    smi.write_text(
        f"#!/bin/sh\n# eagle31-mla test stand-in: the memory of the stand-in device, in MiB\necho {80 << 10}\n"
    )
    smi.chmod(0o755)
    os.environ["PATH"] = f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"
    _installed = True
