"""llama.cpp's own block products, in a process of its own (bench/ggmlkernels.py runs this module with `python -m`).

ggml's native code and its OpenMP runtime stay out of bench's process, so a crash there (a CPU feature the build
uses and the machine refuses) is a missing rate with its reason, not a lost bench. Standard library, numpy and ctypes
only, on llama-cpp-python's own ggml libraries (llama_cpp/lib), without importing llama_cpp itself.

Each product runs as llama.cpp's CPU backend runs a decode's: the weights placed as its model loader places them
(extra buffer types on: the first of the CPU device's extra buffer types, AMX or CPU_REPACK, whose mul_mat takes
them, copied in with ggml_backend_tensor_set, which repacks them; else the plain CPU buffer and ggml's mul_mat on the
blocks as stored: its vec_dot kernels, or llamafile's where the build has them), activations fp32, converted by its
mul_mat to its q8 type (q8_0, q8_K) per call, every matrix of the pool one mul_mat node of ONE graph (a token's
forward is one graph), computed with ggml_backend_graph_compute on a CPU backend of the given thread count, whose
OpenMP threads and work buffer persist between sweeps (ggml_graph_compute_with_ctx would take a new work buffer
from the context on every call).

stdin:  {"threads", "repeats", "pool_bytes", "extra_buffers", "x": [cols floats],
         "products": [{"type", "ggml_type", "rows", "cols", "file"}]}  (file: rows x row bytes of blocks, raw)
stdout: one JSON line each, flushed: {"ready": version} once the libraries are bound, then per product
        {"type", "bytes_per_s", "buffer", "y"} (y: the first matrix's product with x) or {"type", "error"};
        or one {"skip": reason}.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

P, I64, SZ, INT, BOOL = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_int, ctypes.c_bool
STR = ctypes.c_char_p
F32 = 0  # GGML_TYPE_F32
USAGE_WEIGHTS = 1  # GGML_BACKEND_BUFFER_USAGE_WEIGHTS, as the model loader marks its weight buffers
LOG_WARN = 3  # GGML_LOG_LEVEL_WARN: warnings and errors go to stderr, the per-tensor repack messages do not
LOG_CALLBACK = ctypes.CFUNCTYPE(None, INT, STR, P)
EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(P), P)  # ggml_backend_dev_get_extra_bufts_t


class InitParams(ctypes.Structure):  # struct ggml_init_params
    _fields_ = [("mem_size", SZ), ("mem_buffer", P), ("no_alloc", BOOL)]


# name: (library, result, arguments), as ggml.h, ggml-alloc.h, ggml-backend.h and ggml-cpu.h of ggml 0.25 declare them
SIGNATURES = {
    "ggml_version": ("base", STR, ()),
    "ggml_log_set": ("base", None, (LOG_CALLBACK, P)),
    "ggml_init": ("base", P, (InitParams,)),
    "ggml_free": ("base", None, (P,)),
    "ggml_tensor_overhead": ("base", SZ, ()),
    "ggml_graph_overhead": ("base", SZ, ()),
    "ggml_row_size": ("base", SZ, (INT, I64)),
    "ggml_new_tensor_2d": ("base", P, (P, INT, I64, I64)),
    "ggml_mul_mat": ("base", P, (P, P, P)),
    "ggml_new_graph": ("base", P, (P,)),
    "ggml_build_forward_expand": ("base", None, (P, P)),
    "ggml_backend_alloc_ctx_tensors_from_buft": ("base", P, (P, P)),
    "ggml_backend_buffer_set_usage": ("base", None, (P, INT)),
    "ggml_backend_buffer_free": ("base", None, (P,)),
    "ggml_backend_buft_name": ("base", STR, (P,)),
    "ggml_backend_tensor_set": ("base", None, (P, P, SZ, SZ)),
    "ggml_backend_tensor_get": ("base", None, (P, P, SZ, SZ)),
    "ggml_backend_dev_supports_op": ("base", BOOL, (P, P)),
    "ggml_backend_reg_dev_get": ("base", P, (P, SZ)),
    "ggml_backend_reg_get_proc_address": ("base", P, (P, STR)),
    "ggml_backend_graph_compute": ("base", INT, (P, P)),
    "ggml_backend_free": ("base", None, (P,)),
    "ggml_cpu_init": ("cpu", None, ()),
    "ggml_backend_cpu_reg": ("cpu", P, ()),
    "ggml_backend_cpu_init": ("cpu", P, ()),
    "ggml_backend_cpu_set_n_threads": ("cpu", None, (P, INT)),
    "ggml_backend_cpu_buffer_type": ("cpu", P, ()),
}
LIBRARIES = {"base": "ggml-base", "cpu": "ggml-cpu"}


def bind() -> tuple[SimpleNamespace | None, str]:
    """(ggml's functions, the version) or (None, why not: no llama_cpp, a library or a function missing)."""
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except ValueError:
        spec = None
    if spec is None or not spec.origin:
        return None, "llama-cpp-python is not installed (pip install llama-cpp-python)"
    where = Path(spec.origin).parent / "lib"
    libs = {}
    for key, stem in LIBRARIES.items():
        found = [where / f"{pre}{stem}{ext}" for pre in ("lib", "") for ext in (".so", ".dylib", ".dll")]
        path = next((p for p in found if p.is_file()), None)
        if path is None:
            return None, f"llama_cpp/lib has no lib{stem} library"
        try:  # RTLD_GLOBAL: the CPU library resolves its ggml-base symbols from the one loaded here
            libs[key] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            return None, f"lib{stem} does not load: {e}"
    g = SimpleNamespace()
    for name, (lib, result, args) in SIGNATURES.items():
        fn = getattr(libs[lib], name, None)
        if fn is None:
            return None, f"lib{LIBRARIES[lib]} has no {name} (another ggml version)"
        fn.restype, fn.argtypes = result, list(args)
        setattr(g, name, fn)
    try:
        package = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        package = "?"
    return g, f"llama-cpp-python {package} (ggml {g.ggml_version().decode()})"


def quiet(g) -> None:
    """ggml's warnings and errors to stderr (the parent reports the last line of a crash), not its debug chatter."""

    def log(level, text, _):
        if level >= LOG_WARN and level != 5 and text:  # 5: a continuation of the previous line
            sys.stderr.write(text.decode(errors="replace"))

    g.log = LOG_CALLBACK(log)  # kept: ggml holds the pointer
    g.ggml_log_set(g.log, None)


def buffer_types(g, dev, extra: bool) -> list[int]:
    """The weight buffer types the model loader tries, in its order: the CPU device's extra ones, then the CPU's."""
    found = []
    address = g.ggml_backend_reg_get_proc_address(g.ggml_backend_cpu_reg(), b"ggml_backend_dev_get_extra_bufts")
    if extra and address:
        listed = EXTRA_BUFTS(address)(dev)
        i = 0
        while listed and listed[i]:
            found.append(listed[i])
            i += 1
    return [*found, g.ggml_backend_cpu_buffer_type()]


def context(g, tensors: int, graph: bool = False) -> int:
    """A ggml context holding TENSORS tensors' headers (and a graph's), their data in a backend buffer."""
    size = tensors * g.ggml_tensor_overhead() + (g.ggml_graph_overhead() if graph else 0) + 1024
    ctx = g.ggml_init(InitParams(size, None, True))
    if not ctx:
        raise RuntimeError("ggml_init failed")
    return ctx


def placement(g, dev, buffers: list[int], gtype: int, rows: int, cols: int) -> int:
    """The first of BUFFERS whose device takes the mul_mat of a [rows x cols] weight in it (the loader's test)."""
    for buft in buffers[:-1]:
        wctx, actx = context(g, 1), context(g, 2)
        try:
            w = g.ggml_new_tensor_2d(wctx, gtype, cols, rows)
            buf = g.ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft)
            if not buf:
                continue
            x = g.ggml_new_tensor_2d(actx, F32, cols, 1)
            taken = g.ggml_backend_dev_supports_op(dev, g.ggml_mul_mat(actx, w, x))
            g.ggml_backend_buffer_free(buf)
            if taken:
                return buft
        finally:
            g.ggml_free(wctx)
            g.ggml_free(actx)
    return buffers[-1]


def measure(g, backend, dev, buffers, req: dict, product: dict) -> dict:
    """Bytes of blocks per second over the pool, the best of the timed sweeps after a warm-up one."""
    gtype, rows, cols = product["ggml_type"], product["rows"], product["cols"]
    size = rows * g.ggml_row_size(gtype, cols)
    blocks = np.fromfile(product["file"], dtype=np.uint8)
    if blocks.size != size:
        raise ValueError(f"{product['type']}: {blocks.size} bytes of blocks, ggml expects {size}")
    count = max(1, req["pool_bytes"] // size)  # as many weights as fill the pool (each its own copy of the blocks)
    buft = placement(g, dev, buffers, gtype, rows, cols)
    wctx, actx = context(g, count), context(g, count + 1, graph=True)
    wbuf = abuf = None
    try:
        weights = [g.ggml_new_tensor_2d(wctx, gtype, cols, rows) for _ in range(count)]
        wbuf = g.ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft)
        if not wbuf:
            raise MemoryError(f"{product['type']}: no {count} x {size} bytes of weights")
        g.ggml_backend_buffer_set_usage(wbuf, USAGE_WEIGHTS)
        for w in weights:  # into the extra buffer types' own layout (repacked) where one was chosen
            g.ggml_backend_tensor_set(w, blocks.ctypes.data, 0, size)
        x = g.ggml_new_tensor_2d(actx, F32, cols, 1)
        ys = [g.ggml_mul_mat(actx, w, x) for w in weights]
        graph = g.ggml_new_graph(actx)
        for y in ys:
            g.ggml_build_forward_expand(graph, y)
        abuf = g.ggml_backend_alloc_ctx_tensors_from_buft(actx, g.ggml_backend_cpu_buffer_type())
        if not abuf:
            raise MemoryError("no buffer for the activations")
        xs = np.ascontiguousarray(req["x"], dtype=np.float32)
        g.ggml_backend_tensor_set(x, xs.ctypes.data, 0, xs.nbytes)
        best = float("inf")
        for sweep in range(req["repeats"] + 1):
            start = time.perf_counter()
            status = g.ggml_backend_graph_compute(backend, graph)
            if sweep:
                best = min(best, time.perf_counter() - start)
            if status != 0:
                raise RuntimeError(f"ggml_backend_graph_compute returned status {status}")
        out = np.empty(rows, dtype=np.float32)
        g.ggml_backend_tensor_get(ys[0], out.ctypes.data, 0, out.nbytes)
        return {
            "type": product["type"],
            "bytes_per_s": size * count / max(best, 1e-9),
            "buffer": g.ggml_backend_buft_name(buft).decode(),
            "y": out.tolist(),
        }
    finally:
        for buf in (wbuf, abuf):
            if buf:
                g.ggml_backend_buffer_free(buf)
        g.ggml_free(wctx)
        g.ggml_free(actx)


def main(req: dict, say) -> None:
    g, version = bind()
    if g is None:
        say({"skip": version})
        return
    quiet(g)
    g.ggml_cpu_init()
    dev = g.ggml_backend_reg_dev_get(g.ggml_backend_cpu_reg(), 0)
    backend = g.ggml_backend_cpu_init()
    if not dev or not backend:
        say({"skip": "ggml has no CPU device or backend"})
        return
    g.ggml_backend_cpu_set_n_threads(backend, int(req["threads"]))
    buffers = buffer_types(g, dev, req.get("extra_buffers", True))
    say({"ready": version})
    try:
        for product in req["products"]:
            try:
                say(measure(g, backend, dev, buffers, req, product))
            except (OSError, RuntimeError, ValueError, MemoryError) as e:  # this product only; a crash ends the run
                say({"type": product["type"], "error": str(e)})
    finally:
        g.ggml_backend_free(backend)


def _say(answer: dict) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(json.loads(sys.stdin.read()), _say)
