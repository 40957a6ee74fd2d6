"""Medusa's static candidate tree (pure Python: the scheduler sizes verify chunks by it,
gpu/medusa.py fills and verifies them).

A tree is a list of paths of top-k ranks: path (r0, r1, ...) is head 0's r0-th guess,
then head 1's r1-th guess under it, and so on.  Nodes are sorted by depth, so any prefix
of the list is itself a tree: a verify chunk cut short by the token budget is still one.
"""

from __future__ import annotations

from dataclasses import dataclass

# The static candidate tree, as paths of top-k ranks (path[d] is the rank of the token
# head d proposes).  Medusa ships trees of 63 nodes for a GPU, where a verify of 64 query
# rows costs what one row does; on a CPU each row costs a share of the step (the layers'
# products grow with the rows once past a handful), so this one keeps 16 nodes: the
# top-4 of the first head, the likeliest second and third guesses under the first two,
# and the top chain to depth 4 with its best siblings.  Deeper heads (K > 4) extend the
# top-1 chain.
TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
)  # fmt: skip
MAX_TREE_ROWS = 64  # root + nodes: the attention paths' bitmask is one int64 per row


def tree_paths(depth: int) -> list[tuple[int, ...]]:
    """The static tree cut to `depth` levels (then the top-1 chain below TREE's last level),
    sorted by depth (stable), so every prefix of the list is a tree."""
    paths = [p for p in TREE if len(p) <= depth]
    deepest = max(len(p) for p in TREE)
    paths += [(0,) * d for d in range(deepest + 1, depth + 1)]
    paths.sort(key=len)
    return paths[: MAX_TREE_ROWS - 1]


@dataclass
class Tree:
    """One request's candidate tree for this step: node i is paths[i]."""

    tokens: list[int]  # node i's token
    parents: list[int]  # node i's parent node, -1: the root
    depths: list[int]  # node i's depth, 1..

    @property
    def size(self) -> int:
        return len(self.tokens)

    def offsets(self) -> list[int]:
        """Each chunk row's position past the root's (row 0 is the root)."""
        return [0, *self.depths]

    def bits(self) -> list[int]:
        """Each chunk row's visible rows of the chunk, as a bitmask (signed int64)."""
        out = [1]
        for i, par in enumerate(self.parents):
            out.append(out[par + 1] | (1 << (i + 1)))
        return [b - (1 << 64) if b >= 1 << 63 else b for b in out]

    def children(self) -> list[list[int]]:
        """Per chunk row, its children's nodes in rank order."""
        kids: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, par in enumerate(self.parents):
            kids[par + 1].append(i)
        return kids


def build_tree(topk: list[list[int]], num_nodes: int) -> Tree:
    """The first `num_nodes` nodes of the static tree over these ranked guesses
    (topk[d][r]: head d's r-th most likely token)."""
    depth = len(topk)
    paths = tree_paths(depth)[:num_nodes]
    index = {p: i for i, p in enumerate(paths)}
    tokens, parents, depths = [], [], []
    for p in paths:
        tokens.append(topk[len(p) - 1][p[-1]])
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
        depths.append(len(p))
    return Tree(tokens, parents, depths)


def tree_size(depth: int) -> int:
    return len(tree_paths(depth))


def tree_depth(num_nodes: int, max_depth: int = 16) -> int:
    """Depth of the first `num_nodes` nodes of the static tree."""
    paths = tree_paths(max_depth)[:num_nodes]
    return max((len(p) for p in paths), default=0)
