"""Build hook for the one optional C extension; everything else is in pyproject.toml.

``sparrowd.codec._native`` fuses the compare and the gather of a diff into one
pass over memory. It is optional: where no C compiler is available the
install still succeeds and the codec uses its numpy path (same output, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sparrowd.codec._native",
            sources=["sparrowd/codec/_native.c"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ]
)
