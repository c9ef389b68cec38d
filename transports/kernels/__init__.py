"""Triton kernels of the ``ipc`` transport: collectives over every rank's peer-mapped buffer.

Each rank owns a *region*: a data buffer plus a small signal area of int64 words
(:mod:`transports.kernels.layout`). Kernels receive tables of every rank's buffer and signal-area
addresses (int64 tensors) and read their peers' memory directly: over NVLink/PCIe P2P on GPUs
(regions opened with CUDA IPC), or in POSIX shared memory under Triton's interpreter
(``TRITON_INTERPRET=1``), where pointers are host addresses. One kernel body serves both.

Importing this package imports triton; in a process that emulates on the CPU, ``TRITON_INTERPRET``
must be set before that (see :func:`transports.ipc.load_kernels`): ``triton.jit`` picks the
interpreter when a kernel is defined.
"""
