"""List the files of an unpacked nixl-cu12 or nixl-cu13 wheel that NIXL's UCX backend needs (tests/gpu_wheels.sh).

Why: the wheel is 59-68 MB, more than one device call may carry beside the suite's other wheels (64 MiB in all),
while the KV transfer tests (tests/executor/test_kv_transfer_nixl.py) use only the NIXL bindings, the UCX plugin
and UCX's transport modules. The InfiniBand modules are left out: the GPU machine has no InfiniBand device, and
on hosts without one their bundled libnl crashed every process that made an agent at exit (kv_transfer_nixl.py
says more). What is kept: the Python package, its extension modules, the UCX plugin, every UCX module but IB and
perftest, and every shared library these need, found by walking their ELF NEEDED entries (readelf) among the
wheel's own libraries.

    python tests/gpu_nixl_trim.py UNPACKED_WHEEL_DIR > files.txt   (paths relative to that directory)
"""
import glob
import os
import subprocess
import sys


def needed_libraries(path: str) -> list[str]:
    """The sonames a shared object links against (its dynamic section's NEEDED entries)."""
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def package_name(root: str) -> str:
    """The wheel's Python package: nixl_cu12 or nixl_cu13 (the same files, built against CUDA 12 or 13)."""
    names = [os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(root, "nixl_cu*", "_api.py"))]
    if len(names) != 1:
        raise SystemExit(f"{root}: expected one nixl_cu*/_api.py, found {names}")
    return names[0]


def kept_files(root: str) -> list[str]:
    package = package_name(root)
    os.chdir(root)
    bundled = {os.path.basename(p): p for pattern in (f"{package}*/**/*.so*", f".{package}.mesonpy.libs/**/*.so*")
               for p in glob.glob(pattern, recursive=True)}
    ucx_modules = [p for p in glob.glob(f"{package}.libs/ucx/*.so*")
                   if "perftest" not in p and not os.path.basename(p).startswith("libuct_ib")]
    roots = glob.glob(f"{package}/*.so") + [f".{package}.mesonpy.libs/plugins/libplugin_UCX.so"] + ucx_modules
    kept, stack = set(), list(roots)
    while stack:  # the closure of the roots over the wheel's own libraries (system ones stay the system's)
        path = stack.pop()
        if path in kept:
            continue
        kept.add(path)
        stack.extend(bundled[name] for name in needed_libraries(path) if name in bundled)
    kept |= set(glob.glob(f"{package}/*.py")) | {f"{package}/py.typed"}
    kept |= {module.split(".so")[0] + ".la" for module in ucx_modules}  # UCX reads its modules' .la beside them
    return sorted(p for p in kept if os.path.exists(p))


if __name__ == "__main__":
    print("\n".join(kept_files(sys.argv[1])))
