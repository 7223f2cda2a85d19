"""Burst UDP I/O over preallocated numpy buffers (recvmmsg/sendmmsg via ctypes), DPDK style."""
