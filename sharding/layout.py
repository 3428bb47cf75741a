"""``StepLayout``: where one compiled step's arrays live on the mesh (a hashable, static jit argument)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import DEFAULT_RULES, MeshAxes, logical_spec, without


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The mesh and the rules table of one step.

    ``split_sequence`` says whether this step's token rows are split over the ``sequence`` axis (prefill
    steps whose token count the axis divides); when False, rows are split over ``data`` only and every
    ``sequence`` shard computes the same rows.
    """

    mesh: Mesh
    rules_items: tuple[tuple[str, MeshAxes], ...]
    split_sequence: bool = False

    @classmethod
    def create(cls, mesh: Mesh, rules: Mapping[str, MeshAxes] = DEFAULT_RULES, *,
               split_sequence: bool = False) -> "StepLayout":
        rules = dict(rules)
        split = split_sequence and mesh.shape["sequence"] > 1
        if not split:
            rules = without(rules, "sequence", ["tokens"])
        return cls(mesh, tuple(sorted(rules.items())), split)

    @property
    def rules(self) -> dict[str, MeshAxes]:
        return dict(self.rules_items)

    def size(self, axis: str) -> int:
        return int(self.mesh.shape[axis])

    def spec(self, axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
        return logical_spec(axes, shape, self.mesh, self.rules)

    def sharding(self, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    def constrain(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
        """``with_sharding_constraint`` by logical axes (inside jit)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape))
