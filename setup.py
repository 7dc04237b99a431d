"""The one compiled part of kvoffd: the disk tier's index probe (kvoffd/cache/tiers/_probe.c, which says
why). Everything else is in pyproject.toml. Optional: without a C compiler and Python's headers the
install still succeeds, and the disk index answers through numpy instead (slower LOOKUPs of disk hits;
``kvoffctl status`` shows ``index_kernel: numpy``)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvoffd.cache.tiers._probe", ["kvoffd/cache/tiers/_probe.c"],
                             extra_compile_args=["-O2"], optional=True)])
