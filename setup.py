"""The native kernels, built at install (pyproject.toml holds everything else).

An install compiles the C++ in rocketllm_cli/native/src with the machine's g++, every variant, into the package
(rocketllm_cli/native/build.py `install`), so a first run neither waits for the compiler nor needs one. Without g++
the install still succeeds, says so, and the kernels build on first use where a compiler is found by then.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _native_build():
    """rocketllm_cli/native/build.py by its path: importing the package would import torch, absent at build time."""
    spec = importlib.util.spec_from_file_location("rocketllm_native_build", HERE / "rocketllm_cli/native/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildNativeKernels(build_ext):
    """build_ext for the one "extension": a ctypes library, compiled by the project's own build code."""

    def get_ext_filename(self, fullname):
        package = fullname.split(".")[:-1]
        return os.path.join(*package, _native_build().prebuilt_name())

    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        reason = _native_build().install(target)
        if reason:
            print(f"rocketllm: native kernels not built at install ({reason}); they build on first use instead")


class AnyPythonWheel(bdist_wheel):
    """The library is plain C++ called through ctypes: a wheel for this platform, whatever the Python."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


setup(
    ext_modules=[Extension("rocketllm_cli.native.librocketllm_native", sources=[], optional=True)],
    cmdclass={"build_ext": BuildNativeKernels, "bdist_wheel": AnyPythonWheel},
)
