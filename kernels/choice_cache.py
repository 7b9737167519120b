"""A persistent cache of the load-time kernel CHOICES (not of compiled binaries: Triton's own disk
cache keeps those).

Why: every CUDA engine load times candidate kernels (kernels/linear.py choose_skinny_weights and
friends, kernels/wide_rows.py, kernels/fp8.py, kernels/wna16.py, the PDL choice of
engine/executor/cuda_graphs.py), compiling each candidate on a cold Triton cache. On an H200
(2026-11-29) the 8B tree engine's choices took 20.0 s (bf16) / 43.7 s (FP8), the INT4 engine at max
batch 256 40.4 s, and servers restart on the same GPUs all the time. A hit returns the stored choice
(and its timings) without compiling or timing the losers; the winner still compiles at graph capture.

Key (invariant: whatever can change a choice is in it): the GPU (name, compute capability, SM count),
torch and Triton versions, a digest of the candidate list and of the source files of the kernels the
choice covers (editing a kernel or its candidates invalidates it), then the choice's own key (shape,
dtype, rows...). Value: what the timing function returned (choice and timings), encoded in JSON with
tuples and non-string dict keys kept. A stored value that ``valid`` rejects (not among today's
candidates) is ignored and re-timed.

Where: the directory $TRITONLLM_KERNEL_CHOICE_CACHE (default $TRITONLLM_CACHE/kernel_choices, that is
~/.cache/tritonllm/kernel_choices unless set; made on demand); "off" (or "0") disables it. One JSON
file per family; a write takes the family's lock file (flock), re-reads, merges and replaces the file
atomically (temp file + rename), so ranks starting at once neither corrupt it nor drop each other's
entries. An unwritable location only disables the cache for the process, with one stderr line.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import threading
from time import perf_counter
from typing import Any, Callable

CACHE_ENV = "TRITONLLM_KERNEL_CHOICE_CACHE"
# tritonllm/paths.py's cache_dir() ($TRITONLLM_CACHE, default ~/.cache/tritonllm), read here (kernels/ imports no
# package above it), then this subdirectory.
SUBDIR = "kernel_choices"
_OFF = ("off", "0")

_disabled_reason: list[str] = []  # set once the location proved unwritable (the stderr line printed)
# Per thread: its open counting() blocks; a lookup counts in those of its own thread, so two executors loading
# at once in one process (disaggregated serving: a load per thread) each report their own "(cached: h of n)"
_counting = threading.local()
_source_digests: dict[tuple[str, int, int], str] = {}  # (path, mtime_ns, size) -> sha256 of the file
# path -> ((inode, mtime_ns, size), parsed family file): a lookup parses the file once, not once per lookup (it
# keeps every digest's entries: after many kernel edits, thousands of them). A write replaces the file (a new inode).
_parsed: dict[str, tuple[tuple[int, int, int], dict]] = {}


def cache_dir() -> str | None:
    """The cache directory, or None when the cache is off (by the variable, or unwritable earlier)."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() in _OFF or _disabled_reason:
        return None
    if value:
        return os.path.expanduser(value)
    root = os.environ.get("TRITONLLM_CACHE") or os.path.expanduser(os.path.join("~", ".cache", "tritonllm"))
    return os.path.join(root, SUBDIR)


@contextlib.contextmanager
def counting():
    """Counts the lookups this thread makes inside the block: yields {"hits": h, "lookups": n, "families": {family:
    [h, n]}, "seconds": {family: s}}, filled as they happen (the load_phase line reads it at the end: "(cached: h of
    n)"); "seconds": the wall time of each family's timings (its misses: compiles included, what a cold load pays)."""
    counts = {"hits": 0, "lookups": 0, "families": {}, "seconds": {}}
    counters = _open_counters()
    counters.append(counts)
    try:
        yield counts
    finally:
        counters.remove(counts)


def _open_counters() -> list[dict]:
    if not hasattr(_counting, "open"):
        _counting.open = []
    return _counting.open


def _count(family: str, hit: bool, seconds: float = 0.0) -> None:
    for counts in _open_counters():
        counts["lookups"] += 1
        counts["hits"] += hit
        per = counts["families"].setdefault(family, [0, 0])
        per[0] += hit
        per[1] += 1
        if not hit:
            counts["seconds"][family] = counts["seconds"].get(family, 0.0) + seconds


def slowest_families(counts: dict, top: int = 4) -> str:
    """The families whose timings took longest in a counting() block: "moe_gemv 20.1 s, skinny 5.2 s" (or "")."""
    seconds = sorted(counts.get("seconds", {}).items(), key=lambda item: -item[1])[:top]
    return ", ".join(f"{family} {s:.1f} s" for family, s in seconds if s >= 0.05)


def _timed(time: Callable[[], Any]) -> tuple[Any, float]:
    """(time(), its wall seconds)."""
    began = perf_counter()
    value = time()
    return value, perf_counter() - began


def device_fingerprint(device) -> dict:
    """What of the machine a choice depends on: the GPU, its SM count (a MIG slice differs), torch and Triton."""
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    fingerprint = {"torch": torch.__version__, "triton": triton_version}
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        fingerprint.update(gpu=props.name, capability=[props.major, props.minor], sms=props.multi_processor_count)
    else:
        fingerprint.update(gpu=device.type)
    return fingerprint


def _file_digest(path: str) -> str:
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _source_digests:
        with open(path, "rb") as f:
            _source_digests[key] = hashlib.sha256(f.read()).hexdigest()
    return _source_digests[key]


def family_digest(device, sources: tuple[str, ...], candidates: Any) -> str:
    """sha256 over the device fingerprint, the sources' contents (sorted by path) and repr(candidates)."""
    digest = hashlib.sha256(json.dumps(device_fingerprint(device), sort_keys=True).encode())
    for path in sorted(set(sources)):
        digest.update(os.path.basename(path).encode() + b"\0" + _file_digest(path).encode())
    digest.update(repr(candidates).encode())
    return digest.hexdigest()[:32]


def without_timings(report: Any) -> Any:
    """A choice's report with the timings (keys "us", "all_us", "*_us", "*_ms") and a hit's "cached" mark left
    out: what was chosen, equal between a load that timed it and one that read it (tests, benchmarks)."""
    if isinstance(report, dict):
        return {k: without_timings(v) for k, v in report.items()
                if k != "cached" and not (k in ("us", "all_us") or str(k).endswith(("_us", "_ms")))}
    return report


# ---- JSON with tuples and non-string dict keys (the choices are tuples keyed by row counts) ----------

def encode(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"t": [encode(v) for v in value]}
    if isinstance(value, list):
        return {"l": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"choice_cache: cannot store a {type(value).__name__}")


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        (tag, items), = value.items()
        if tag == "t":
            return tuple(decode(v) for v in items)
        if tag == "l":
            return [decode(v) for v in items]
        return {decode(k): decode(v) for k, v in items}
    return value


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # absent, unreadable or torn by hand: every key misses


def _read_parsed(path: str) -> dict:
    """_read, parsed again only when the file changed (read only: _write re-reads under its lock)."""
    try:
        stat = os.stat(path)
    except OSError:
        return {}
    key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    held = _parsed.get(path)
    if held is None or held[0] != key:
        held = _parsed[path] = (key, _read(path))
    return held[1]


def _disable(reason: str) -> None:
    if not _disabled_reason:
        _disabled_reason.append(reason)
        print(f"kernel choice cache disabled: {reason} (set {CACHE_ENV} to a writable directory, or off)",
              file=sys.stderr, flush=True)


def _write(directory: str, family: str, entry_key: str, entry: dict) -> None:
    """Merge one entry into the family's file under its lock; temp file + rename, so a reader sees the
    old file or the new one, never a torn one."""
    import fcntl

    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{family}.json")
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read(path)
            data[entry_key] = entry
            fd, tmp = tempfile.mkstemp(prefix=f".{family}.", suffix=".tmp", dir=directory)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=0, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as error:
        _disable(f"cannot write {directory}: {error.strerror or error}")


def choice(family: str, key: Any, device, time: Callable[[], Any], *, sources: tuple[str, ...] = (),
           candidates: Any = (), valid: Callable[[Any], bool] = lambda value: True) -> tuple[Any, bool]:
    """The value of ``time()`` for ``key`` of ``family`` on ``device``: stored from an earlier run when
    present and ``valid``, else timed now and stored. Returns (value, hit). ``sources``: the files of
    the kernels (and of the candidates) the choice covers; ``candidates``: today's candidate list
    (repr'd into the digest). Off (the variable, or an unwritable location): ``time()`` as without."""
    directory = cache_dir()
    if directory is None:
        value, seconds = _timed(time)
        _count(family, False, seconds)
        return value, False
    entry_key = family_digest(device, sources, candidates) + "|" + repr(key)
    stored = _read_parsed(os.path.join(directory, f"{family}.json")).get(entry_key)
    if isinstance(stored, dict) and "value" in stored:
        try:
            value = decode(stored["value"])
            if valid(value):
                _count(family, True)
                return value, True
        except (ValueError, TypeError, KeyError, IndexError):
            pass  # an entry of another shape: timed again and overwritten
    value, seconds = _timed(time)
    _count(family, False, seconds)
    try:
        encoded = encode(value)
    except TypeError:
        return value, False  # (not storable: timed every load, as without the cache)
    _write(directory, family, entry_key, {"key": repr(key), "value": encoded})
    return value, False


def timed_report(family: str, key: Any, device, time: Callable[[], dict], **kwargs) -> dict:
    """choice() for a choice whose value is a timing report (a dict): a hit's report says "cached": True
    (its timings are those of the load that timed it, which the benches must not take for this load's)."""
    report, hit = choice(family, key, device, time, **kwargs)
    return {**report, "cached": True} if hit else report
