"""Loads the Triton kernels that earlier processes compiled, on a thread of its own while the
checkpoint loads, so that a new process's first engine build finds them in place (`tts synth`
builds its engine in a new process on every run).

Why: with every kernel already compiled on disk, a new process's first engine build took 1.60 s
against 0.34 s for a second build in the same process (H200, 512 rows, docs/bench.md, "`tts synth`
end to end"). Nearly all of the difference was each kernel specialization's first launch, one after
another in the CUDA-graph warm-up, and 0.31 s in `use_fused_kernels`' first call, which imports the
kernel modules. (cuBLAS's first calls at the engine's shapes, in the same warm-up, are not helped.)

What a specialization's first launch does in Triton 3.6 (triton/runtime/jit.py, `JITFunction.run`):
the key of its arguments misses the function's per-device kernel cache (`device_caches[device][0]`,
key string -> CompiledKernel), so `_do_compile` calls `triton.compile`, which hashes the source,
specialization and options, finds the binary in Triton's on-disk cache and reads its metadata and
every stage's file into a CompiledKernel; then the launch (`CompiledKernel.run`) loads the binary
into the CUDA context and builds the launcher, a C module per signature also loaded from that
cache. `JITFunction.preload(data)` does the first part for a specialization serialized as
`serialize_specialization_data` writes it, and files the kernel under the key recorded with it,
the very string that `run` computes (`compute_cache_key`), so the launch finds it;
`CompiledKernel._init_handles()` (private: skipped where missing) does the second part. Left to the
first launch: binding the arguments, computing the key, the launch. Importing the recorded
functions' modules on the thread also takes those imports off the engine's path.

Recorded: at exit (`record`, registered by `start`), every specialization in the kernel caches of
this package's JIT functions (Gluon's subclass JITFunction), serialized with Triton's own
`serialize_specialization_data`. Not through Triton's `jit_post_compile_hook`: with that hook set,
Triton serializes every specialization of every JIT function as it compiles, and a constant that
JSON cannot hold would raise from the launch itself. The caches keep no options object, so the
options come from the kernel's metadata, and a record is kept only where what `preload` will decode
from it gives the kernel's own on-disk cache hash (not so where Triton rewrote `num_warps` in the
metadata: warp-specialized kernels) and its constants are plain values that come back as they were:
otherwise the preload would compile a kernel from scratch, or another one.

The file: `<Triton cache dir>/tts-kernels-<digest>.json`, the digest of the Triton version, the GPU
target and this package's sources: under another Triton or an edited kernel the binaries are not on
disk, and the preload would compile them. The specializations launched by the process that writes
come first, then the file's others, at most MAX_RECORDS; written to a temporary file, then
os.replace.

Loaded: `start(device)` runs `load` on a daemon thread, `finish()` waits for it (a process that
exits before stops it after the record it is at, and waits for that). The synthesizer
starts it before the checkpoint loads and waits for it once the codec has loaded, before any engine
is built (the 1.7B model takes 7-13 s to load on the H200, the first launches ~1.2 s).

Best effort: a missing or unreadable file, a Triton whose API differs, a renamed kernel are logged
once and skipped; those kernels then load at their first launch, as without this module.
TTS_KERNEL_PRELOAD=0 switches recording and loading off.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib
import inspect
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = __name__.rpartition(".")[0]   # tts_kernels
SOURCES = Path(__file__).resolve().parent
SWITCH = "TTS_KERNEL_PRELOAD"
# Records kept per file, the most recently launched first: a bound on what a union of many
# configurations' specializations costs to load.
MAX_RECORDS = 2048

_thread: threading.Thread | None = None
_stop = threading.Event()   # set at exit: the preload ends after the record it is loading
_loaded: set[tuple[str, str]] = set()   # (function, key) the preload put into the kernel caches
_recording = False
_said: set[str] = set()


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def _say_once(message: str, *args, level: int = logging.INFO) -> None:
    if message not in _said:
        _said.add(message)
        log.log(level, message, *args)


def digest(triton_version: str, target: str, sources: Path = SOURCES) -> str:
    """What a record file is valid for: one Triton, one GPU target, these kernel sources."""
    h = hashlib.sha256(f"{triton_version}\n{target}\n".encode())
    for path in sorted(sources.glob("*.py")):
        data = path.read_bytes()
        h.update(f"{path.name} {len(data)}\n".encode() + data)
    return h.hexdigest()[:16]


def target_name(target) -> str:
    """A Triton GPUTarget as a string: cuda:90:32."""
    return f"{target.backend}:{target.arch}:{target.warp_size}"


def cache_dir() -> Path:
    try:
        from triton import knobs
        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):   # a Triton before knobs
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def record_path(target: str) -> Path:
    import triton
    return cache_dir() / f"tts-kernels-{digest(triton.__version__, target)}.json"


def read_records(path: Path) -> list[str]:
    """The file's records (Triton's serialized specializations); none where it is missing or
    unreadable, which is said once."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))["records"]
        if not isinstance(records, list) or not all(isinstance(r, str) for r in records):
            raise ValueError("its records are not a list of strings")
        return records
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as error:
        _say_once("kernel preload: %s ignored (%s: %s)", path, type(error).__name__, error)
        return []


def identity(record: str) -> tuple[str, str]:
    """(function, kernel cache key) of a record."""
    data = json.loads(record)
    return data["name"], data["key"]


def loaded() -> int:
    """How many specializations the preload has put into the kernel caches in this process."""
    return len(_loaded)


def loaded_at_launch() -> list[str]:
    """The functions of the specializations that a launch in this process compiled or read from
    Triton's disk cache itself, the preload not having loaded them (one entry each)."""
    return sorted(entry.name for entry in _compiled(_jit_functions()) if (entry.name, entry.key) not in _loaded)


# Loading

def start(device) -> None:
    """On a CUDA device, loads the recorded specializations on a daemon thread (`load`) and records
    this process's at exit; once per process. Nothing where switched off or under Triton's
    interpreter."""
    global _thread
    import torch

    from tts_kernels import compiled

    device = torch.device(device)
    if _thread is not None or device.type != "cuda" or not enabled() or not compiled():
        return
    record_at_exit()
    if device.index is not None:
        index = device.index
    else:   # the device Triton will launch on; a thread's device is 0 until one is set
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    _thread = threading.Thread(target=_load_quietly, args=(index,), name="tts-kernel-preload", daemon=True)
    _thread.start()


def finish() -> int:
    """Waits for the preload that `start` began, if any; returns how many specializations it loaded."""
    if _thread is not None:
        _thread.join()
    return len(_loaded)


def _load_quietly(device_index: int) -> None:
    try:
        load(device_index)
    except Exception as error:   # an optimisation only: the kernels load at their first launch
        _say_once("kernel preload: nothing loaded (%s: %s)", type(error).__name__, error)


def load(device_index: int) -> int:
    """Loads the specializations recorded for this GPU into this process's kernel caches, on the
    calling thread, with the device made current there; returns how many it loaded."""
    import torch
    from triton.runtime.driver import driver

    began = time.perf_counter()
    torch.cuda.set_device(device_index)
    device = driver.active.get_current_device()
    path = record_path(target_name(driver.active.get_current_target()))
    records = read_records(path)
    functions: dict[str, object] = {}
    count, missing, failed, first_error = 0, 0, 0, None
    for record in records:
        if _stop.is_set():
            break
        try:
            name, key = identity(record)
            if name not in functions:
                functions[name] = _function(name)
            fn = functions[name]
            if fn is None:   # renamed or gone since it was recorded
                missing += 1
                continue
            if key in fn.device_caches[device][0]:
                continue
            kernel = fn.preload(record)
            if kernel is None:   # a jit_cache_hook declined it
                continue
            if hasattr(kernel, "_init_handles"):
                kernel._init_handles()
            _loaded.add((name, key))
            count += 1
        except Exception as error:
            failed += 1
            first_error = first_error or error
    if failed:
        _say_once("kernel preload: %d of %d records not loaded (first: %s: %s)", failed, len(records),
                  type(first_error).__name__, first_error)
    if missing:
        _say_once("kernel preload: %d records name functions not found", missing, level=logging.DEBUG)
    if records:
        log.info("kernel preload: %d kernels loaded in %.2f s (%s)", count, time.perf_counter() - began, path.name)
    return count


def _function(name: str):
    """The JIT function that Triton names `module.function`, its module imported; None if gone."""
    module_name, _, attribute = name.rpartition(".")
    if module_name != PACKAGE and not module_name.startswith(PACKAGE + "."):
        return None
    from triton.runtime.jit import JITFunction
    try:
        fn = getattr(importlib.import_module(module_name), attribute, None)
    except ImportError:
        return None
    return fn if isinstance(fn, JITFunction) else None


# Recording

def record_at_exit() -> None:
    global _recording
    if not _recording:
        atexit.register(_at_exit)
        _recording = True


def _at_exit() -> None:
    # The preload thread stopped and joined first (a process that exits while the checkpoint loads):
    # a daemon thread still in CUDA or Triton calls when the interpreter finalizes can crash it.
    _stop.set()
    if _thread is not None:
        _thread.join()
    record()


def record() -> int:
    """Merges the specializations in this process's kernel caches into the record files (one per GPU
    target); returns how many records it wrote. Nothing where switched off."""
    if not enabled() or "triton" not in sys.modules:
        return 0
    try:
        return _record()
    except Exception as error:
        _say_once("kernel preload: nothing recorded (%s: %s)", type(error).__name__, error)
        return 0


@dataclass
class _Entry:
    name: str
    key: str
    fn: object
    kernel: object
    target: object
    backend: object
    launched: bool   # a launch in this process asked for it (not only the preload)


def _jit_functions() -> dict[str, object]:
    """This package's JIT functions in the modules imported so far, by the name Triton records."""
    if "triton" not in sys.modules:
        return {}
    from triton.runtime.jit import JITFunction
    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == PACKAGE or module_name.startswith(PACKAGE + ".")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, JITFunction) and value.fn.__module__ == module_name:
                found[f"{module_name}.{value.fn.__qualname__}"] = value
    return found


def _compiled(functions: dict[str, object]) -> list[_Entry]:
    entries = []
    for name, fn in functions.items():
        for caches in list(fn.device_caches.values()):
            kernel_cache, key_cache, target, backend = caches[0], caches[1], caches[2], caches[3]
            launched = set(key_cache.values())   # filled by run()'s compute_cache_key, not by preload
            for key, kernel in list(kernel_cache.items()):
                entries.append(_Entry(name, key, fn, kernel, target, backend, key in launched))
    return entries


def _record() -> int:
    by_target: dict[str, list[_Entry]] = {}
    for entry in _compiled(_jit_functions()):
        by_target.setdefault(target_name(entry.target), []).append(entry)
    import triton

    written = 0
    for target, entries in by_target.items():
        path = record_path(target)
        old = read_records(path)
        known = {}
        for record in old:
            try:
                known[identity(record)] = record
            except (ValueError, KeyError, TypeError):
                pass
        launched, others = {}, {}
        for entry in entries:
            record = known.get((entry.name, entry.key)) or _serialize(entry)
            if record is not None:
                (launched if entry.launched else others)[(entry.name, entry.key)] = record
        merged = dict(launched)
        for ident, record in list(known.items()) + list(others.items()):
            merged.setdefault(ident, record)
        records = list(merged.values())[:MAX_RECORDS]
        if records != old:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f"{path.name}.tmp.{os.getpid()}")
            try:
                temporary.write_text(json.dumps({"triton": triton.__version__, "target": target, "records": records}),
                                     encoding="utf-8")
                os.replace(temporary, path)
            finally:
                temporary.unlink(missing_ok=True)
            written += len(records)
    return written


def _serialize(entry: _Entry) -> str | None:
    """The entry as Triton's serialize_specialization_data writes it, or None where JITFunction.preload
    would not bring back this very kernel."""
    kernel = entry.kernel
    src = getattr(kernel, "src", None)
    if not (hasattr(src, "constants") and hasattr(src, "signature") and hasattr(kernel, "hash")):
        return None   # not compiled from a function's source, or still compiling
    if not all(_plain(value) for value in src.constants.values()):
        _say_once("kernel preload: %s not recorded (a constant JSON would not give back)", entry.name,
                  level=logging.DEBUG)
        return None
    try:
        from triton.runtime.jit import serialize_specialization_data

        fields = entry.backend.parse_options({}).__dict__
        metadata = kernel.metadata._asdict()
        options = entry.backend.parse_options({k: _tuples(metadata[k]) for k in fields if k in metadata})
        args = [entry.name, src.signature, src.constants, src.attrs, options, entry.key]
        if "target" in inspect.signature(serialize_specialization_data).parameters:   # newer Triton (3.9); not 3.6
            args.append(entry.target)
        record = serialize_specialization_data(*args)
        if _comes_back(record, entry):
            return record
        _say_once("kernel preload: %s not recorded (its record does not give its cache hash)", entry.name,
                  level=logging.DEBUG)
        return None
    except Exception as error:   # a value JSON cannot hold, or a Triton whose internals differ
        _say_once("kernel preload: %s not recorded (%s: %s)", entry.name, type(error).__name__, error,
                  level=logging.DEBUG)
        return None


def _plain(value) -> bool:
    """A constant that JSON and JITFunction.preload give back as it was: None, bool, int, float, a str
    that is no dtype's name, or a Triton dtype (written as its name)."""
    import triton.language as tl
    if value is None or type(value) in (bool, int, float):
        return True
    if type(value) is str:
        return not tl.dtype.is_dtype(value)
    return type(value) is tl.dtype


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _comes_back(record: str, entry: _Entry) -> bool:
    """Whether the record, decoded as JITFunction.preload decodes it, names the kernel's own entry in
    Triton's disk cache (the hash of source, specialization, options and environment)."""
    import triton.language as tl
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key

    data = json.loads(record)
    signature = {k: _tuples(v) for k, v in data["signature"].items()}
    constants = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else v
                 for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    options = entry.backend.parse_options({k: tuple(v) if isinstance(v, list) else v
                                           for k, v in data["options"].items()})
    src = type(entry.kernel.src)(entry.fn, signature, constants, attrs)
    key = get_cache_key(src, entry.backend, options, get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest() == entry.kernel.hash
