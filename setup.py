"""The optional compiled kernel (stoker._kernels); everything else is in pyproject.toml.

``optional=True``: where no C compiler is found the install still succeeds and stoker uses
its pure-numpy path (same results, slower; see stoker.transforms).
"""

import sys

from setuptools import Extension, setup

# -ffp-contract=off: no fused multiply-add, so the kernel rounds exactly as numpy does.
flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-fast-math"]
setup(ext_modules=[Extension("stoker._kernels", ["src/stoker/_kernels.c"], extra_compile_args=flags, optional=True)])
