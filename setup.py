"""Builds the optional native Adam kernel (offload/optim/adam_native.c).

Everything else about the package is in pyproject.toml. The kernel is plain C
loaded with ctypes (no Python C API); where it cannot be compiled the install
still succeeds and `CpuAdam` runs torch's kernels instead, with a log line.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "offload.optim._adam_native",
            sources=["offload/optim/adam_native.c"],
            # -ffp-contract=off: the order of roundings is torch's (see the file's
            # head); target_clones in the source picks AVX-512 / AVX2 at load time.
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno",
                                "-fno-trapping-math", "-fvisibility=hidden"],
            optional=True,
        )
    ],
)
