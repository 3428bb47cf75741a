"""Writing a step's new K/V rows into their pages: Pallas kernels with ``reference.write_kv``'s contract."""

from pallas_kernels.kv_cache_update.gpu import write_kv_gpu
from pallas_kernels.kv_cache_update.tpu import write_kv_tpu

__all__ = ["write_kv_gpu", "write_kv_tpu"]
