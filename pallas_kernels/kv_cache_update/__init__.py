"""Writing a step's new K/V rows into their pages: Pallas kernels with ``ragged_paged_attention.write_kv``'s
contract (the same ``pallas_kernels.metadata.AttentionMetadata``)."""

from pallas_kernels.kv_cache_update.gpu import write_kv_gpu
from pallas_kernels.kv_cache_update.tpu import write_kv_tpu

__all__ = ["write_kv_gpu", "write_kv_tpu"]
