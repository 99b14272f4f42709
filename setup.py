"""Build hook for the one optional C extension; everything else is in pyproject.toml.

``sparrowd.codec._native`` fuses the compare and the gather of a diff into one
pass over memory. It is optional: where no C compiler is available the
install still succeeds and the codec uses its numpy path (same output, slower).
"""

import hashlib
import platform
from pathlib import Path

from setuptools import Extension, setup

XXHASH = "sparrowd/codec/vendor/xxhash"  # xxHash 0.8.4 (BSD-2-Clause), see its README.md
NATIVE = "sparrowd/codec/_native.c"
# The source's digest, built in (_native.SOURCE): a checkout whose rebuild failed keeps its old
# module, and sparrowd.codec.bits warns when the two differ (the build is optional, so quiet).
SOURCE = hashlib.blake2b(Path(NATIVE).read_bytes(), digest_size=8).hexdigest()
sources, macros = [NATIVE, f"{XXHASH}/xxhash.c"], [("SPARROWD_SOURCE", f'"{SOURCE}"')]
if platform.machine().lower() in ("x86_64", "amd64"):
    # XXH3 for SSE2, AVX2 and AVX-512 in one object, the widest the CPU runs picked at run time;
    # built with baseline flags so the extension runs on any x86-64.
    sources.append(f"{XXHASH}/xxh_x86dispatch.c")
    macros.append(("SPARROWD_XXH_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "sparrowd.codec._native",
            sources=sources,
            include_dirs=[XXHASH],
            define_macros=macros,
            extra_compile_args=["-O3", "-std=c11"],
            libraries=["m"],
            optional=True,
        )
    ]
)
