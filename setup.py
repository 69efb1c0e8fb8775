"""Builds the C++ sample-index extension; all metadata lives in pyproject.toml."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "megatron_mlmclm._sample_index",
        ["csrc/sample_index.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
