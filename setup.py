"""The compiled kernels (stoker._kernels); everything else is in pyproject.toml.

Optional by default: where no C compiler is found the install still succeeds and stoker uses
its pure-numpy path (same results, slower), and says so once with a warning (stoker.kernels).
``STOKER_REQUIRE_KERNELS=1`` makes a failed compile fail the build: ``make wheel`` sets it,
so a wheel never ships without its kernels.
"""

import os
import sys

from setuptools import Extension, setup

# -ffp-contract=off: no fused multiply-add, so the kernel rounds exactly as numpy does.
flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-fast-math"]
required = os.environ.get("STOKER_REQUIRE_KERNELS", "") not in ("", "0")
setup(
    ext_modules=[
        Extension("stoker._kernels", ["src/stoker/_kernels.c"], extra_compile_args=flags, optional=not required)
    ]
)
