"""Builds the optional C helper of the shm transport (everything else is in pyproject.toml).

``optional=True``: without a working C compiler the build only warns and moecomm still installs; the
shm transport then runs its Python path (transports/_native.py logs that once per process).
-ffp-contract=off -fno-fast-math: the reductions must stay bitwise identical to the Python path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "transports._shmfast",
            ["transports/_shmfast.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        )
    ]
)
