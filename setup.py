"""The two compiled parts of kvoffd: the disk tier's index probe (kvoffd/cache/tiers/_probe.c) and the
pool checksum's pass (kvoffd/cache/_rowsum.c); each file says why. Everything else is in pyproject.toml.
Optional: without a C compiler and Python's headers the install still succeeds, and both answer
through numpy instead (slower LOOKUPs of disk hits, ``kvoffctl status`` shows ``index_kernel:
numpy``; slower checksums)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvoffd.cache.tiers._probe", ["kvoffd/cache/tiers/_probe.c"],
                             extra_compile_args=["-O2"], optional=True),
                   Extension("kvoffd.cache._rowsum", ["kvoffd/cache/_rowsum.c"],
                             extra_compile_args=["-O3"], optional=True)])
