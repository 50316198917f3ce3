"""Which sharded dimensions must split identically, and in what units (whole heads, experts).

Two tensors' dimensions are *linked* when some strategy shards them as the same index: ``x[..., k]``
and ``w[:, k]`` in a contraction must hold exactly the same slice of ``k`` on each device. A reshape
links ``[b, s, 768]`` dim 2 with ``[b, s, 12, 64]`` dim 2 with *units*: boundaries of the first must
fall on multiples of 64 elements so each device holds whole heads.

Each connected component ``C`` of linked ``(tensor, dim)`` pairs is cut into ``A_C`` *atoms*:
member ``(e, d)`` of size ``n`` has ``n / A_C`` elements per atom, and ``A_C`` is the largest
count making every member's atom a multiple of its unit: ``A_C = gcd_members(n / unit)``. Given
ratios, the atoms are rounded once per component (``hapc.balance.rounding``) and every member
gets ``atoms_j * n / A_C`` elements -- identical splits by construction.
"""

from __future__ import annotations

import math

Key = tuple[int, int]  # (node index, dim)


class Granularity:
    """Union-find over ``(node, dim)`` with sizes and units."""

    def __init__(self) -> None:
        self._parent: dict[Key, Key] = {}
        self._size: dict[Key, int] = {}
        self._unit: dict[Key, int] = {}

    def add(self, key: Key, size: int, unit: int = 1) -> None:
        if key not in self._parent:
            self._parent[key] = key
            self._size[key] = size
            self._unit[key] = 1
        self._unit[key] = math.lcm(self._unit[key], max(1, unit))

    def find(self, key: Key) -> Key:
        root = key
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[key] != root:
            self._parent[key], key = root, self._parent[key]
        return root

    def link(self, a: Key, b: Key) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self._parent[rb] = ra

    def atoms(self, key: Key) -> int:
        """Number of atoms of ``key``'s component (1 if ``key`` was never sharded)."""
        if key not in self._parent:
            return 1
        root = self.find(key)
        a = 0
        for k in self._parent:
            if self.find(k) == root:
                a = math.gcd(a, self._size[k] // self._unit[k])
        return max(a, 1)

    def component(self, key: Key) -> list[Key]:
        root = self.find(key)
        return sorted(k for k in self._parent if self.find(k) == root)

    def freeze(self) -> dict[Key, tuple[int, Key]]:
        """``key -> (atoms, component root)`` for every key, computed once."""
        roots: dict[Key, int] = {}
        for k in self._parent:
            r = self.find(k)
            roots[r] = math.gcd(roots.get(r, 0), self._size[k] // self._unit[k])
        return {k: (max(roots[self.find(k)], 1), self.find(k)) for k in self._parent}
