"""Packed low-bit weights: formats, exact GGUF conversion, RTN quantization and the kernels that compute on them.

    packed = from_gguf(reader.tensors[i].data, reader.tensors[i].tensor_type)   # or quantize_rtn(weight, bits=4)
    manifest_entry = packed.format.to_dict()
    bound = bind(packed, "cpu", torch.bfloat16)     # kernel layout where a kernel runs, else the portable parts
    y = linear(x, bound)                            # the kernel, or dequantize into the scratch buffer + F.linear

Modules: nibbles (4-bit code order), fromgguf (GGUF blocks -> portable),
fromint (compressed-tensors, GPTQ and AWQ integer codes -> portable),
rtn (round-to-nearest quantization), dequant (portable -> float), scratch (the one reusable buffer), layout
(portable -> torch's kernel layouts, the op calls), probe (which kernels work on a device), dense (a kernel-bound
weight multiplied densely for many rows), compute (bind, linear). The descriptors and PackedTensor live below,
in checkpoint/packedformat.py: a shard set's manifest records them.

Importing the package is cheap: each name below loads its module (and torch) when first used.
"""

from ..lazy import exports

_HOME = {
    "PackedFormat": "..checkpoint.packedformat",
    "PackedTensor": "..checkpoint.packedformat",
    "from_gguf": "fromgguf",
    "quantize_rtn": "rtn",
    "dequantize": "dequant",
    "dequantize_into": "dequant",
    "Scratch": "scratch",
    "SCRATCH": "scratch",
    "Capabilities": "probe",
    "capabilities": "probe",
    "BoundWeight": "bound",
    "bind": "compute",
    "kernel_path": "compute",
    "linear": "compute",
}

__all__ = sorted(_HOME)


__getattr__ = exports(__name__, _HOME)
