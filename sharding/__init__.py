"""Device meshes and the logical-axis rules that place params, activations and the KV cache on them."""

from sharding.mesh import MeshConfig, make_mesh
from sharding.rules import DEFAULT_RULES, logical_sharding, logical_spec

__all__ = ["MeshConfig", "make_mesh", "DEFAULT_RULES", "logical_sharding", "logical_spec"]
