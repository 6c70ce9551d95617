"""Build the native kernel library from its C++ sources (./src) with the machine's g++, once, into the cache.

    path, reason = library()   # (Path of the .so, "") or (None, a one-line reason); never raises

The library lands in cache_dir()/native/<key>/ where key hashes the sources, the compiler's version and the flags:
an edit, another compiler or other flags build afresh, and nothing stale is ever loaded. No -march: every SIMD
function carries its own target attribute and the library picks a variant at run time, so one build runs on any
CPU of its architecture. The sources compile in parallel (the SIMD files take most of the few seconds) into a
temporary folder, and the library is renamed into place: two processes building at once each finish their own
build, and the last rename wins with the same bytes.

Each variant is a file of its own (scalar.cpp, avx2.cpp, avx512.cpp; an x86 one's int16 kernels in a second,
avx2_int16.cpp and avx512_int16.cpp, so that they compile in parallel), and by default only the best one this CPU runs
is compiled (and the one ROCKETLLM_NATIVE_ISA caps at, where set): the others never run here, and compiling them
cost a first run seconds of its two cores. ROCKETLLM_NATIVE_VARIANTS=all (the tests set it) builds every variant.
The variant set is part of the key.

An install builds it first (setup.py calls `install`): every variant, into the package as
librocketllm_native-<key>.so, the key a hash of the sources and the flags. `library()` takes that one when its key is
the installed sources' (an edited checkout's is not), so a first run neither waits for g++ nor needs it; without a
compiler at install the build waits for first use, as before. ROCKETLLM_NATIVE_VARIANTS set to less than all asks for
a build of those variants, in the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).with_name("src")
COMPILER = "g++"
# -ffp-contract=off: the scalar reference rounds exactly as written on every platform (the SIMD code's FMAs are
# explicit intrinsics either way); hidden visibility: only the rl_* entry points are exported (no PLT calls inside)
FLAGS = ("-O3", "-fPIC", "-std=c++17", "-pthread", "-ffp-contract=off", "-fvisibility=hidden")
LIBRARY = "librocketllm_native.so"
ISAS = ("scalar", "avx2", "avx512")  # the variants, each in its own file, in the library's numbering; later is faster
ISA_ENV = "ROCKETLLM_NATIVE_ISA"  # caps the variant at run time (native/__init__.py): the build includes it
VARIANTS_ENV = "ROCKETLLM_NATIVE_VARIANTS"  # "all", or a comma-separated list: the variants to compile
# what the library's own cpuid check asks of each x86 variant (src/api.cpp runnable_isas), as /proc/cpuinfo names it
NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
}
BUILD_TIMEOUT_S = 300
PREBUILT_DIR = Path(__file__).parent  # where an install puts its build (setup.py)


def library(every: bool = False) -> tuple[Path | None, str]:
    """The built library's path, building it if needed, or None and why not. EVERY: with every variant compiled in,
    whatever wanted_variants() says."""
    if os.name != "posix":
        return None, f"unsupported platform {sys.platform}: the native kernels build with g++ on Linux"
    if not any(SOURCE_DIR.glob("*.cpp")):
        return None, f"the native kernels' C++ sources are not installed (nothing in {SOURCE_DIR})"
    named = _named_variants()
    if every or named is None or named == ISAS:  # no subset of the variants asked for: the install's build serves
        installed = prebuilt()
        if installed is not None:
            return installed, ""
    cxx = shutil.which(COMPILER)
    if cxx is None:
        return None, f"no C++ compiler: {COMPILER} is not on PATH (install g++ for the native kernels)"
    variants = ISAS if every else wanted_variants()
    try:
        folder = _cache_folder(cxx, variants)
        target = folder / LIBRARY
        if target.is_file():
            return target, ""
        folder.mkdir(parents=True, exist_ok=True)
        from ..threads import background_priority

        reason = _build(cxx, folder, target, variants, background_priority)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"native kernel build failed: {_one_line(str(exc))}"
    return (target, "") if not reason else (None, reason)


def prebuilt() -> Path | None:
    """The library an install built from these very sources, or None (no install build, or sources edited since)."""
    path = PREBUILT_DIR / prebuilt_name()
    return path if path.is_file() else None


def prebuilt_name() -> str:
    """The file name an install gives its build: the key hashes the sources and the flags (every variant is in)."""
    digest = _sources_digest()
    digest.update(f"{' '.join(FLAGS)}\0{','.join(ISAS)}".encode())
    return f"{Path(LIBRARY).stem}-{digest.hexdigest()[:20]}.so"


def build_id(path: Path) -> str:
    """A built library's key, for measurements kept per build: its cache folder's name, or an install's file key."""
    path = Path(path)
    return path.parent.name if path.name == LIBRARY else "install-" + path.stem.rpartition("-")[2]


def install(target: Path) -> str:
    """Build every variant into `target` (setup.py, at install); "" or the one-line reason it could not."""
    cxx = shutil.which(COMPILER)
    if os.name != "posix" or cxx is None:
        return f"no C++ compiler ({COMPILER} not on PATH)"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return _build(cxx, target.parent, target, ISAS)  # its scratch folder beside the target: renamed in place
    except (OSError, subprocess.SubprocessError) as exc:
        return f"native kernel build failed: {_one_line(str(exc))}"


def _sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h"))


def _sources_digest():
    """A sha256 of the sources' names and bytes, for a key to add its own inputs to."""
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest


def _cache_folder(cxx: str, variants: tuple[str, ...]) -> Path:
    from ..cachehome import cache_dir

    digest = _sources_digest()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    machine = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, timeout=30).stdout
    digest.update(f"{version}\0{machine}\0{' '.join(FLAGS)}\0{','.join(variants)}".encode())
    return cache_dir() / "native" / digest.hexdigest()[:20]


def wanted_variants(flags: set[str] | None = None) -> tuple[str, ...]:
    """The variants to compile: ROCKETLLM_NATIVE_VARIANTS's, else the best this CPU runs by its flags (FLAGS, default
    /proc/cpuinfo's; every variant where they cannot be read) and the one ROCKETLLM_NATIVE_ISA caps at."""
    named = _named_variants()
    if named is not None:
        return named
    flags = _cpu_flags() if flags is None else flags
    if flags is None:
        return ISAS
    best = next((v for v in reversed(ISAS) if all(f in flags for f in NEEDS.get(v, ()))), "scalar")
    cap = os.environ.get(ISA_ENV, "").strip()
    return tuple(v for v in ISAS if v == best or (v == cap and ISAS.index(cap) < ISAS.index(best)))


def _named_variants() -> tuple[str, ...] | None:
    """The variants ROCKETLLM_NATIVE_VARIANTS names ("all": every one), or None where it names none."""
    raw = os.environ.get(VARIANTS_ENV, "").strip().lower()
    if not raw:
        return None
    named = ISAS if raw == "all" else tuple(v for v in ISAS if v in {p.strip() for p in raw.split(",")})
    return named or None


def _cpu_flags() -> set[str] | None:
    """The CPU's flags (x86); an empty set on another architecture (its one variant is the scalar one); None where
    they cannot be read."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    return cpuinfo_flags()


def cpuinfo_flags() -> set[str] | None:
    """The first CPU's flags as /proc/cpuinfo lists them ("flags" on x86, "Features" on Arm); None where the file
    cannot be read or lists none (the machine probe's cpu_flags reads them here too)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        return None
    return None


def _build(cxx: str, folder: Path, target: Path, variants: tuple[str, ...], priority=None) -> str:
    """Compile the shared .cpp files and VARIANTS' to objects in parallel (each compiler started under `priority`, a
    preexec function), link them, rename into `target`; "" or the reason."""
    with tempfile.TemporaryDirectory(prefix="build-", dir=folder) as scratch:
        objects, jobs = [], []
        for source in (p for p in _sources() if p.suffix == ".cpp" and _variant_of(p) in (None, *variants)):
            obj = Path(scratch) / (source.stem + ".o")
            objects.append(str(obj))
            cmd = [cxx, *FLAGS, "-c", str(source), "-o", str(obj)]
            jobs.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    preexec_fn=priority,
                )
            )
        errors = [_finish(job) for job in jobs]
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            return f"native kernel build failed: {failed}"
        linked = Path(scratch) / LIBRARY
        link = subprocess.run(
            [cxx, *FLAGS, "-shared", *objects, "-o", str(linked)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            preexec_fn=priority,
        )
        if link.returncode != 0:
            return f"native kernel link failed: {_first_error(link.stderr)}"
        os.replace(linked, target)  # atomic: a reader sees no library or a whole one
    return ""


def _variant_of(source: Path) -> str | None:
    """The variant a source file belongs to: `avx2.cpp` and `avx2_int16.cpp` are avx2's; None for a shared file."""
    return next((v for v in ISAS if source.stem == v or source.stem.startswith(f"{v}_")), None)


def _finish(job: subprocess.Popen) -> str | None:
    try:
        _, stderr = job.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        return f"the compiler ran past {BUILD_TIMEOUT_S} s"
    return None if job.returncode == 0 else _first_error(stderr)


def _first_error(stderr: str) -> str:
    """The first lines that say "error" (else the first lines), joined into one short line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    picked = [line for line in lines if "error" in line.lower()][:2] or lines[:2]
    return _one_line(" | ".join(picked) or "no message from the compiler")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
