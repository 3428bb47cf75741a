"""Dense products ``x @ w`` for XLA:CPU with few rows: a native kernel over both the calling thread and XLA's
intra-op pool (``native.py``, ``cpu_native.cc``), and its reference, ``jnp.dot`` accumulated in f32."""

from pallas_kernels.matmul.native import dense, dense_reference

__all__ = ["dense", "dense_reference"]
