"""What this host can do for gdsload: the report behind ``gdsload doctor``.

`collect()` probes the CUDA driver and cuFile libraries (through ctypes) and the optional Python
modules (KvikIO, CuPy, DALI, torch, WebDataset, grpc), and derives which I/O path and which DALI
decode device gdsload will use. `render()` turns that report into a short human-readable table.

Every probe is guarded: on a CPU-only host nothing raises, and each failure is reported as a string.
Heavy modules are imported only inside `collect()`; importing this module needs the stdlib only.
Some native libraries (cuFile among them) print diagnostics straight to file descriptor 1, which
would corrupt ``gdsload doctor --json``; the probes redirect the process's stdout/stderr
descriptors while they run and keep that text under ``report["native_output"]``. That redirection
is process-wide, so `collect()` is meant for a CLI command, not for a busy multi-threaded process.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import os
import platform
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

CPU_ONLY_STATEMENT = (
    "No CUDA device: gdsload runs on the CPU path (POSIX reads, DALI CPU decoders, host memory)."
)

CUDA_DRIVER_LIBRARY = "libcuda.so.1"
CUFILE_LIBRARIES = ("libcufile.so.0", "libcufile.so")

# Report key -> (import name, candidate distribution names, label used by `render`).
MODULES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "kvikio": ("kvikio", ("kvikio-cu12", "kvikio-cu13", "kvikio"), "KvikIO"),
    "cupy": ("cupy", ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"), "CuPy"),
    "dali": (
        "nvidia.dali",
        ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110", "nvidia-dali"),
        "DALI",
    ),
    "torch": ("torch", ("torch",), "PyTorch"),
    "webdataset": ("webdataset", ("webdataset",), "WebDataset"),
    "grpc": ("grpc", ("grpcio",), "gRPC"),
}

# The names the I/O backends call themselves (`Backend.name`, `DataLoader.stats()["io_path"]`).
IO_PATHS = ("kvikio-gds", "kvikio-compat", "posix")
DECODE_DEVICES = ("mixed", "cpu", "unavailable")

_MAX_NATIVE_OUTPUT = 4000  # characters of captured native-library output kept per probe


def _describe(exc: BaseException) -> str:
    """One line naming the exception type and its message."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__


@contextlib.contextmanager
def _captured_native_output(sink: list[str], label: str) -> Iterator[None]:
    """Send whatever is written to fds 1 and 2 meanwhile to `sink` instead of the terminal.

    Falls back to no redirection when the descriptors cannot be duplicated (fd 1 closed, no
    POSIX descriptors); the body still runs.
    """
    saved: dict[int, int] = {}
    capture = None
    try:
        capture = tempfile.TemporaryFile(mode="w+b")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd in (1, 2):
            saved[fd] = os.dup(fd)
            os.dup2(capture.fileno(), fd)
    except OSError:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        saved.clear()
        if capture is not None:
            capture.close()
            capture = None
    try:
        yield
    finally:
        if capture is not None:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            _flush_c_stdio()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            try:
                capture.seek(0)
                text = capture.read().decode("utf-8", "replace").strip()
            except OSError:
                text = ""
            finally:
                capture.close()
            if text:
                sink.append(f"[{label}] {text[:_MAX_NATIVE_OUTPUT]}")


def _flush_c_stdio() -> None:
    """fflush(NULL): push text that C code buffered in libc's stdio into the captured descriptor."""
    try:
        libc = ctypes.CDLL(None)
        libc.fflush(None)
    except (OSError, AttributeError, TypeError):
        pass


def _cuda_error_name(lib: Any, code: int) -> str:
    """`CUDA_ERROR_...` name of a driver API result code, or the bare number."""
    try:
        name = ctypes.c_char_p()
        if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return f"{name.value.decode()} ({code})"
    except (AttributeError, OSError, UnicodeDecodeError):
        pass
    return f"CUresult {code}"


def _probe_cuda() -> dict[str, Any]:
    """Load libcuda.so.1 through ctypes; read the driver version and the devices it sees."""
    info: dict[str, Any] = {
        "library": CUDA_DRIVER_LIBRARY,
        "driver_loaded": False,
        "error": None,
        "driver_version": None,
        "driver_version_int": None,
        "device_count": None,
        "devices": [],
        "device_source": None,
        "device_error": None,
    }
    try:
        lib = ctypes.CDLL(CUDA_DRIVER_LIBRARY)
    except OSError as exc:
        info["error"] = _describe(exc)
        return info
    info["driver_loaded"] = True
    try:
        version = ctypes.c_int(0)
        code = lib.cuDriverGetVersion(ctypes.byref(version))
        if code == 0:
            info["driver_version_int"] = version.value
            info["driver_version"] = f"{version.value // 1000}.{(version.value % 1000) // 10}"
        else:
            info["error"] = f"cuDriverGetVersion failed: {_cuda_error_name(lib, code)}"
    except (AttributeError, OSError) as exc:
        info["error"] = f"cuDriverGetVersion: {_describe(exc)}"
    try:
        code = lib.cuInit(0)
        if code != 0:
            info["device_error"] = f"cuInit failed: {_cuda_error_name(lib, code)}"
            return info
        count = ctypes.c_int(0)
        code = lib.cuDeviceGetCount(ctypes.byref(count))
        if code != 0:
            info["device_error"] = f"cuDeviceGetCount failed: {_cuda_error_name(lib, code)}"
            return info
        info["device_count"] = count.value
        info["device_source"] = "cuda-driver"
        for ordinal in range(count.value):
            device = ctypes.c_int(0)
            name = ctypes.create_string_buffer(256)
            entry: dict[str, Any] = {"index": ordinal, "name": None, "memory_bytes": None}
            if lib.cuDeviceGet(ctypes.byref(device), ordinal) == 0:
                if lib.cuDeviceGetName(name, len(name), device) == 0:
                    entry["name"] = name.value.decode("utf-8", "replace")
                memory = ctypes.c_size_t(0)
                total_mem = getattr(lib, "cuDeviceTotalMem_v2", None) or lib.cuDeviceTotalMem
                if total_mem(ctypes.byref(memory), device) == 0:
                    entry["memory_bytes"] = memory.value
            info["devices"].append(entry)
    except (AttributeError, OSError) as exc:
        info["device_error"] = _describe(exc)
    return info


# Where NVIDIA's pip wheels put libcufile, inside the `nvidia` namespace package: CUDA 13 wheels
# (nvidia-cufile 1.15+, what kvikio-cu13 pulls in through cuda-toolkit[cufile]) group every
# library in nvidia/cu13/lib; CUDA 12 wheels (nvidia-cufile-cu12) use nvidia/cufile/lib.
CUFILE_WHEEL_DIRS = (("cu13", "lib"), ("cu12", "lib"), ("cufile", "lib"))


def _cufile_wheel_candidates() -> list[str]:
    """libcufile shipped by NVIDIA's cuFile wheels (what KvikIO wheels load), if installed."""
    import importlib.util

    paths: list[str] = []
    locations: list[str] = []
    try:
        spec = importlib.util.find_spec("nvidia")
        if spec is not None and spec.submodule_search_locations:
            locations += list(spec.submodule_search_locations)
    except (ImportError, ValueError):
        pass
    # `nvidia` is a namespace package in NVIDIA's wheels, but some (DALI's) ship an __init__.py,
    # which hides the other site directories' nvidia/ folders from find_spec: look in each.
    locations += [os.path.join(p, "nvidia") for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]
    for location in dict.fromkeys(locations):
        for parts in CUFILE_WHEEL_DIRS:
            for name in CUFILE_LIBRARIES:
                candidate = os.path.join(location, *parts, name)
                if os.path.exists(candidate) and candidate not in paths:
                    paths.append(candidate)
    return paths


def _cufile_pathfinder() -> str | None:
    """libcufile as KvikIO itself finds it (`cuda.pathfinder.load_nvidia_dynamic_lib("cufile")`,
    what libkvikio's `load_library()` calls); None without cuda-pathfinder or when not found."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except Exception:
        return None
    try:
        loaded = load_nvidia_dynamic_lib("cufile")
    except Exception:
        return None
    return getattr(loaded, "abs_path", None) or "cuda.pathfinder"


def _probe_cufile_library() -> dict[str, Any]:
    """Whether libcufile can be loaded: system library names first, then the pip wheel's copy."""
    info: dict[str, Any] = {"loaded": False, "library": None, "error": None}
    errors: list[str] = []
    for name in (*CUFILE_LIBRARIES, *_cufile_wheel_candidates()):
        try:
            ctypes.CDLL(name)
        except OSError as exc:
            errors.append(_describe(exc))
            continue
        info["loaded"] = True
        info["library"] = name
        return info
    found = _cufile_pathfinder()
    if found:
        info.update(loaded=True, library=found)
        return info
    info["error"] = errors[0] if errors else "libcufile not found"
    return info


def _distribution_version(candidates: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(distribution name, version) of the first candidate that is installed."""
    for dist in candidates:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken METADATA file must not break the report
            continue
    return None, None


def _probe_module(import_name: str, candidates: tuple[str, ...]) -> tuple[dict[str, Any], Any]:
    """Import `import_name`; report its version or the import error. Never raises.

    Returns the JSON-able report entry and the module (None when the import failed).
    """
    dist, version = _distribution_version(candidates)
    entry: dict[str, Any] = {
        "module": import_name,
        "package": dist,
        "installed": dist is not None,
        "version": version,
        "error": None,
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(import_name)
    except (Exception, SystemExit) as exc:
        entry["error"] = _describe(exc)
        # Absent (the import system found no such module) versus present but broken on import.
        entry["installed"] = not (
            isinstance(exc, ModuleNotFoundError)
            and bool(exc.name)
            and (import_name == exc.name or import_name.startswith(f"{exc.name}."))
        )
        return entry, None
    entry["installed"] = True
    module_version = getattr(module, "__version__", None)
    if isinstance(module_version, str) and module_version:
        entry["version"] = module_version
    return entry, module


def _probe_kvikio_view(kvikio: Any, driver_loaded: bool) -> dict[str, Any]:
    """KvikIO's compat-mode setting, its effective decision and whether cuFile/GDS is usable.

    KvikIO 26.10: `kvikio.defaults.get("compat_mode")` returns a `kvikio.CompatMode` (ON, OFF,
    AUTO); `kvikio.defaults.is_compat_mode_preferred()` is the effective decision once AUTO is
    resolved; `kvikio.cufile_driver.get("is_gds_available")` asks the cuFile driver. Older
    releases had `kvikio.defaults.compat_mode()` (a bool) and `cufile_driver.properties`.
    """
    view: dict[str, Any] = {
        "compat_mode": None,
        "compat_mode_preferred": None,
        "gds_available": None,
        "libcufile_version": None,
        "gds_threshold": None,
        "error": None,
    }
    errors: list[str] = []
    defaults = getattr(kvikio, "defaults", None)
    try:
        if defaults is None:
            defaults = importlib.import_module("kvikio.defaults")
        setting: Any = None
        if callable(getattr(defaults, "get", None)):
            setting = defaults.get("compat_mode")
        elif callable(getattr(defaults, "compat_mode", None)):
            setting = defaults.compat_mode()
        if isinstance(setting, bool):
            view["compat_mode"] = "ON" if setting else "OFF"
        elif setting is not None:
            view["compat_mode"] = str(getattr(setting, "name", setting))
    except Exception as exc:
        errors.append(f"compat_mode: {_describe(exc)}")
    try:
        if defaults is not None and callable(getattr(defaults, "is_compat_mode_preferred", None)):
            view["compat_mode_preferred"] = bool(defaults.is_compat_mode_preferred())
        elif view["compat_mode"] in ("ON", "OFF"):
            view["compat_mode_preferred"] = view["compat_mode"] == "ON"
    except Exception as exc:
        errors.append(f"is_compat_mode_preferred: {_describe(exc)}")
    try:  # device reads below it take KvikIO's POSIX shortcut, not cuFile ("kvikio-posix")
        if defaults is not None and callable(getattr(defaults, "get", None)):
            view["gds_threshold"] = int(defaults.get("gds_threshold"))
    except Exception as exc:
        errors.append(f"gds_threshold: {_describe(exc)}")
    try:
        driver = importlib.import_module("kvikio.cufile_driver")
    except Exception as exc:
        errors.append(f"kvikio.cufile_driver: {_describe(exc)}")
        driver = None
    if driver is not None:
        try:
            if callable(getattr(driver, "libcufile_version", None)):
                major, minor = driver.libcufile_version()
                if major or minor:
                    view["libcufile_version"] = f"{major}.{minor}"
        except Exception as exc:
            errors.append(f"libcufile_version: {_describe(exc)}")
        if not driver_loaded:
            # cuFile needs the CUDA driver; asking it only prints a dlopen error and says False.
            view["gds_available"] = False
        else:
            try:
                if callable(getattr(driver, "get", None)):
                    view["gds_available"] = bool(driver.get("is_gds_available"))
                else:
                    view["gds_available"] = bool(driver.properties.is_gds_available)
            except Exception as exc:
                errors.append(f"is_gds_available: {_describe(exc)}")
    view["error"] = "; ".join(errors) or None
    return view


def _probe_cupy(cupy: Any, entry: dict[str, Any]) -> None:
    """Whether CuPy can allocate device memory, and the devices it sees."""
    entry.update(can_allocate=False, allocate_error=None, device_count=None, devices=[])
    try:
        cupy.zeros(1)
        entry["can_allocate"] = True
    except Exception as exc:
        entry["allocate_error"] = _describe(exc)
        return
    try:
        runtime = cupy.cuda.runtime
        count = int(runtime.getDeviceCount())
        entry["device_count"] = count
        for ordinal in range(count):
            props = runtime.getDeviceProperties(ordinal)
            name = props.get("name", b"")
            if isinstance(name, bytes):
                name = name.decode("utf-8", "replace")
            memory = props.get("totalGlobalMem")
            entry["devices"].append(
                {"index": ordinal, "name": name or None, "memory_bytes": memory}
            )
    except Exception as exc:
        entry["allocate_error"] = f"device query: {_describe(exc)}"


def _probe_torch(torch: Any, entry: dict[str, Any]) -> None:
    """torch.cuda.is_available(), without the warning torch prints on driverless hosts."""
    entry["cuda_available"] = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            entry["cuda_available"] = bool(torch.cuda.is_available())
    except Exception as exc:
        entry["cuda_error"] = _describe(exc)


def io_path_for(
    *,
    kvikio_importable: bool,
    cuda_driver: bool,
    gpu_available: bool,
    gds_available: bool | None,
    compat_mode_preferred: bool | None,
) -> str:
    """The read path gdsload will take.

    The name is the one the backend gdsload would open calls itself (`KvikioBackend.name` before
    any read, `DataLoader.stats()["io_path"]`): "kvikio-gds": KvikIO with a working cuFile driver
    and compat mode not preferred (device reads below KvikIO's `gds_threshold` still take its
    POSIX shortcut and are counted as "kvikio-posix" once read). "kvikio-compat": KvikIO with a
    CUDA driver and a device, but reading through its POSIX compatibility mode (bounce buffers).
    "posix": plain host reads otherwise. A driver that sees no device cannot hold the device
    buffers KvikIO reads into, so that also means "posix".
    """
    if not (kvikio_importable and cuda_driver and gpu_available):
        return "posix"
    if gds_available is True and compat_mode_preferred is False:
        return "kvikio-gds"
    return "kvikio-compat"


def decode_device_for(*, dali_importable: bool, gpu_available: bool) -> str:
    """DALI decode placement: "mixed" (nvJPEG on the GPU), "cpu", or "unavailable" (no DALI)."""
    if not dali_importable:
        return "unavailable"
    return "mixed" if gpu_available else "cpu"


def collect() -> dict[str, Any]:
    """Probe this host; return a JSON-serialisable report. Never raises on a CPU-only host.

    Keys: ``python``, ``platform``, ``cuda``, ``cufile``, one entry per optional module
    (``kvikio``, ``cupy``, ``dali``, ``torch``, ``webdataset``, ``grpc``: ``version`` or None,
    ``error`` when the import fails), ``gpu_available``, ``io_path``, ``decode_device``, ``nvdec``
    (`gdsload.host.gpu.nvdec_caps(0)`: what NVDEC decodes on GPU 0; videos it refuses take the CPU
    path) and ``native_output`` (text native libraries printed while being probed).
    """
    native_output: list[str] = []
    report: dict[str, Any] = {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "platform": platform.platform(),
        },
    }

    try:
        with _captured_native_output(native_output, "cuda"):
            cuda = _probe_cuda()
    except Exception as exc:  # defensive: ctypes oddities must not break the report
        cuda = {"library": CUDA_DRIVER_LIBRARY, "driver_loaded": False, "error": _describe(exc),
                "driver_version": None, "driver_version_int": None, "device_count": None,
                "devices": [], "device_source": None, "device_error": None}
    report["cuda"] = cuda

    try:
        with _captured_native_output(native_output, "cufile"):
            cufile = _probe_cufile_library()
    except Exception as exc:
        cufile = {"loaded": False, "library": None, "error": _describe(exc)}
    report["cufile"] = cufile  # KvikIO's view is added below, once KvikIO has been imported

    modules: dict[str, Any] = {}
    for key, (import_name, candidates, _label) in MODULES.items():
        try:
            with _captured_native_output(native_output, import_name):
                entry, module = _probe_module(import_name, candidates)
                if module is not None and key == "cupy":
                    _probe_cupy(module, entry)
                elif module is not None and key == "torch":
                    _probe_torch(module, entry)
        except Exception as exc:
            entry = {"module": import_name, "package": None, "installed": False,
                     "version": None, "error": _describe(exc)}
            module = None
        report[key] = entry
        modules[key] = module

    kvikio_view: dict[str, Any] = {
        "compat_mode": None,
        "compat_mode_preferred": None,
        "gds_available": None,
        "libcufile_version": None,
        "error": "KvikIO is not importable",
    }
    if modules["kvikio"] is not None:
        try:
            with _captured_native_output(native_output, "kvikio.cufile_driver"):
                kvikio_view = _probe_kvikio_view(modules["kvikio"], bool(cuda["driver_loaded"]))
        except Exception as exc:
            kvikio_view["error"] = _describe(exc)
    cufile["kvikio"] = kvikio_view

    # The CUDA driver is the first source of device facts; CuPy's runtime view fills in when the
    # driver API could not enumerate (e.g. cuInit failed but CuPy works through another route).
    cupy_entry = report["cupy"]
    if cuda.get("device_count") is None and cupy_entry.get("can_allocate"):
        cuda["device_count"] = cupy_entry.get("device_count")
        cuda["devices"] = list(cupy_entry.get("devices") or [])
        cuda["device_source"] = "cupy"

    gpu_available = bool(cuda.get("device_count"))
    report["gpu_available"] = gpu_available
    report["io_path"] = io_path_for(
        kvikio_importable=modules["kvikio"] is not None,
        cuda_driver=bool(cuda.get("driver_loaded")),
        gpu_available=gpu_available,
        gds_available=kvikio_view.get("gds_available"),
        compat_mode_preferred=kvikio_view.get("compat_mode_preferred"),
    )
    report["decode_device"] = decode_device_for(
        dali_importable=modules["dali"] is not None, gpu_available=gpu_available
    )
    # which videos NVDEC takes on GPU 0 (the rest decode on the CPU: gdsload.host.gpu.nvdec_route)
    if gpu_available:
        from gdsload.host.gpu import nvdec_caps

        with _captured_native_output(native_output, "nvdec"):
            report["nvdec"] = nvdec_caps(0)
    else:
        report["nvdec"] = {"available": False, "error": "no CUDA device", "codecs": {}}
    report["native_output"] = native_output
    return report


def _row(label: str, value: str) -> str:
    return f"{label:<16}: {value}"


def _short(text: Any, limit: int = 100) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _gib(value: Any) -> str:
    return f", {value / 2**30:.0f} GiB" if isinstance(value, int) and value > 0 else ""


def _module_line(entry: Any) -> str:
    if not isinstance(entry, dict):
        return "unknown"
    version = entry.get("version")
    package = entry.get("package")
    error = entry.get("error")
    if error:
        if not entry.get("installed"):
            return "not installed"
        named = f"{version} ({package}) " if version and package else ""
        return f"{named}import failed: {_short(error)}"
    if version and package:
        return f"{version} ({package})"
    return str(version or "installed (version unknown)")


def render(report: dict[str, Any]) -> str:
    """A short human-readable table of `report`, one line per item, ending with the derived paths."""
    lines: list[str] = ["gdsload doctor"]
    python = report.get("python") or {}
    plat = report.get("platform") or {}
    lines.append(_row("Python", f"{python.get('version', '?')} ({python.get('implementation', '?')})"))
    lines.append(_row("Platform", str(plat.get("platform") or plat.get("system") or "?")))

    cuda = report.get("cuda") or {}
    gpu = bool(report.get("gpu_available"))
    library = cuda.get("library") or CUDA_DRIVER_LIBRARY
    if cuda.get("driver_loaded"):
        version = cuda.get("driver_version") or "version unknown"
        lines.append(_row("CUDA driver", f"{version} ({library})"))
        devices = cuda.get("devices") or []
        if devices:
            for device in devices:
                lines.append(_row(
                    f"  GPU {device.get('index', '?')}",
                    f"{device.get('name') or 'unnamed'}{_gib(device.get('memory_bytes'))}",
                ))
        else:
            why = cuda.get("device_error")
            lines.append(_row("CUDA devices", f"none ({_short(why)})" if why else "none"))
    else:
        lines.append(_row("CUDA driver", f"not found ({library} absent) - CPU-only host"))

    cufile = report.get("cufile") or {}
    if cufile.get("loaded"):
        lines.append(_row("cuFile library", f"loaded ({cufile.get('library')})"))
    else:
        lines.append(_row("cuFile library", "not found (" + ", ".join(CUFILE_LIBRARIES) + ")"))

    kvikio = report.get("kvikio") or {}
    lines.append(_row("KvikIO", _module_line(kvikio)))
    view = cufile.get("kvikio") or {}
    if kvikio.get("error") is None and kvikio:
        mode = view.get("compat_mode") or "unknown"
        preferred = view.get("compat_mode_preferred")
        effective = {True: "compat (POSIX)", False: "cuFile"}.get(preferred, "unknown")
        lines.append(_row("  compat mode", f"{mode} (effective: {effective})"))
        gds = view.get("gds_available")
        lines.append(_row("  GDS usable", {True: "yes", False: "no"}.get(gds, "unknown")))
        if view.get("gds_threshold") is not None:
            lines.append(_row("  GDS threshold", f"{view['gds_threshold']} bytes (smaller device "
                                                 f"reads: KvikIO's POSIX shortcut)"))
        if view.get("error"):
            lines.append(_row("  KvikIO probe", _short(view["error"])))

    cupy = report.get("cupy") or {}
    cupy_line = _module_line(cupy)
    if cupy.get("error") is None and cupy:
        if cupy.get("can_allocate"):
            cupy_line += "; allocates on the GPU"
        else:
            cupy_line += f"; cannot allocate ({_short(cupy.get('allocate_error'), 70)})"
    lines.append(_row("CuPy", cupy_line))

    lines.append(_row("DALI", _module_line(report.get("dali"))))
    if gpu and report.get("nvdec"):
        from gdsload.host.gpu import nvdec_summary

        lines.append(_row("  NVDEC (GPU 0)", _short(nvdec_summary(report["nvdec"]), 140)))

    torch = report.get("torch") or {}
    torch_line = _module_line(torch)
    if torch.get("error") is None and torch:
        torch_line += f"; torch.cuda.is_available() = {torch.get('cuda_available')}"
    lines.append(_row("PyTorch", torch_line))

    lines.append(_row("WebDataset", _module_line(report.get("webdataset"))))
    lines.append(_row("gRPC", _module_line(report.get("grpc"))))

    lines.append("")
    if not gpu:
        lines.append(CPU_ONLY_STATEMENT)
    lines.append(f"I/O path: {report.get('io_path', 'posix')}")
    lines.append(f"decode device: {report.get('decode_device', 'unavailable')}")
    return "\n".join(lines)
