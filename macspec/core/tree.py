"""Token trees: several candidate continuations verified in one target pass.

A tree's nodes are laid out breadth-first after the root (the context's last id, row 0). In the
pass each row attends to the context and to its own ancestors only, at the position of its depth,
so every node is scored exactly as if its path alone had been fed. After the verdict the caches
keep the accepted path's entries, moved to the positions they belong to.

Acceptance (exact, any temperature): walk down from the root; at each reached node draw y from
the target's distribution p there; if y is one of its children, descend into that child, else
emit y and stop (a leaf's y is the bonus token). Every emitted id is y ~ p of its context, so the
output is distributed exactly as the target's own sampling. This is SpecInfer's multi-candidate
rejection sampling with point-mass candidates: candidate c_j is accepted with probability
p'(c_j), where p' is p with the rejected candidates removed and renormalised, and the final draw
comes from p with all candidates removed; together that is one draw from p, checked for
membership. At temperature 0, p is one-hot and the walk follows the target's argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..base.errors import CacheError
from . import caches, hooks
from .sampling import Distribution


@dataclass
class Tree:
    """Candidate ids below the root, breadth-first: node i is `tokens[i]`, child of `parents[i]`
    (-1: the root). `scores` are the draft's path probabilities (for the policy)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)  # each node's index before prune()

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self, node: int) -> list[int]:
        """Nodes whose parent is `node` (-1: the root)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def check(self) -> None:
        depths = self.depths
        for i, p in enumerate(self.parents):
            if not -1 <= p < i or (i and depths[i] < depths[i - 1]):
                raise ValueError(f"tree node {i}: parent {p} breaks the breadth-first layout")


def ancestors(tree: Tree, node: int) -> set[int]:
    """The node, its ancestors and the root (-1)."""
    return {-1, *tree.path(node)} if node >= 0 else {-1}


def attend(tree: Tree, context: int, columns: list[int], rows: list[int]) -> mx.array:
    """(len(rows), context + len(columns)) boolean mask: a row (a node, -1 the root) sees the
    `context` cached entries and, of the nodes stored after them in `columns` order, its
    ancestors and itself."""
    allowed = [[c in ancestors(tree, r) for c in columns] for r in rows]
    tree_part = mx.array(allowed, dtype=mx.bool_)
    return mx.concatenate([mx.ones((len(rows), context), dtype=mx.bool_), tree_part], axis=1)


class _TreeRoPE(nn.Module):
    """A RoPE module rotating each breadth-first depth group at its depth's position instead
    of consecutive ones (the model passes the offset where the group's first row is stored)."""

    def __init__(self, rope: nn.Module, groups: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self.rope, self.groups = rope, groups  # (first row, end row, position)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        # Rows of one depth share a position: each becomes a length-1 sequence at it.
        parts = [
            self.rope(x[..., a:b, None, :], offset=pos)[..., 0, :] for a, b, pos in self.groups
        ]
        return mx.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]


def depth_groups(depths: list[int], base: int) -> list[tuple[int, int, int]]:
    """(first row, end row, position) of each run of rows at one depth; row r at base + depth."""
    groups: list[tuple[int, int, int]] = []
    for r, d in enumerate(depths):
        if groups and groups[-1][2] == base + d:
            groups[-1] = (groups[-1][0], r + 1, base + d)
        else:
            groups.append((r, r + 1, base + d))
    return groups


@contextmanager
def tree_pass(
    model: nn.Module, cache: list, mask: mx.array, depths: list[int], base: int
) -> Iterator[None]:
    """Run the model's next forward as a tree pass: its rows attend as `mask` says (see
    `attend`), row r rotated at position base + depths[r] (depths non-decreasing). Full-attention
    caches only (CacheError otherwise): a window or a recurrent state holds one branch."""
    layers = list(caches.layers(cache))
    for i, c in layers:
        if type(c) is not KVCache:
            raise CacheError(
                f"layer {i}'s {type(c).__name__} cannot verify a token tree (full attention only)"
            )
    groups = depth_groups(depths, base)
    positions = mx.array([base + d for d in depths], dtype=mx.int32)
    # foreign: mlx-lm's attention modules are those with a `rope` (no common base class)
    attentions = [m for _, m in model.named_modules() if callable(getattr(m, "rope", None))]
    ropes = [m.rope for m in attentions]
    # An accelerator that rotates rows without the module's `rope` is told their positions.
    with hooks.tree_positions(attentions, positions, base + max(depths) + 1):
        for m, rope in zip(attentions, ropes, strict=True):
            m.rope = _TreeRoPE(rope, groups)
        for _, c in layers:
            c.make_mask = lambda *args, **kwargs: mask
        try:
            yield
        finally:
            for m, rope in zip(attentions, ropes, strict=True):
                m.rope = rope
            for _, c in layers:
                del c.make_mask


def compact(cache: list, start: int, rows: list[int]) -> None:
    """Keep, of the rows a tree pass appended at `start`, these (in order) at start, start + 1..
    and drop the rest."""
    index = mx.array([start + r for r in rows])
    for _, c in caches.layers(cache):
        if type(c) is not KVCache:
            raise CacheError(f"a {type(c).__name__} cannot keep a tree's path")
        k, v = mx.take(c.keys, index, axis=2), mx.take(c.values, index, axis=2)
        c.keys[..., start : start + len(rows), :] = k
        c.values[..., start : start + len(rows), :] = v
        c.offset = start + len(rows)


def walk(tree: Tree, samples: list[int]) -> tuple[list[int], int]:
    """The acceptance walk over one target sample per row (row 0 the root): (accepted nodes,
    the emitted target id)."""
    node, accepted = -1, []
    while True:
        y = samples[node + 1]
        child = next((c for c in tree.children(node) if tree.tokens[c] == y), None)
        if child is None:
            return accepted, y
        accepted.append(child)
        node = child


@dataclass(frozen=True)
class TreeShape:
    """What a tree round drafts: `depth` levels, each keeping the `width` likeliest candidates
    (by the draft's path probability) and expanding them; the target verifies at most
    `max_nodes` of them, the likeliest."""

    depth: int
    width: int
    max_nodes: int

    @property
    def max_k(self) -> int:
        return min(self.depth * self.width, self.max_nodes)


def fit(shape: TreeShape, room: int, widest: int | None = None) -> TreeShape | int:
    """The shape cut to a round that may emit at most room + 1 ids (0: a plain step), and to a
    pass of at most `widest` ids (its root and nodes; None: any)."""
    nodes = shape.max_nodes if widest is None else min(shape.max_nodes, widest - 1)
    if room < 1 or nodes < 1:
        return 0
    return TreeShape(min(shape.depth, room), shape.width, nodes)


def grow(
    shape: TreeShape,
    expand: Callable[[Tree, list[int]], mx.array],
    root_probs: mx.array,
    vocab_ids: list[int] | None = None,
) -> Tree:
    """A tree grown level by level from the draft's probabilities (EAGLE-2's dynamic tree):
    each level keeps the `width` candidates of highest path probability among the children of
    the level before; `expand(tree, nodes)` returns the draft's probabilities after each of the
    given nodes. Returns the `max_nodes` likeliest nodes, breadth-first (a child is never
    likelier than its parent, so they form a tree)."""
    tree = Tree()
    frontier, probs = [-1], root_probs
    for level in range(shape.depth):
        p = probs.astype(mx.float32)
        top = mx.argpartition(-p, kth=min(shape.width, p.shape[-1]) - 1, axis=-1)[:, : shape.width]
        conf = mx.take_along_axis(p, top, axis=-1)
        top, conf = top.tolist(), conf.tolist()
        candidates = []
        for r, node in enumerate(frontier):
            base = 1.0 if node < 0 else tree.scores[node]
            candidates += [(base * c, node, t) for t, c in zip(top[r], conf[r], strict=True)]
        candidates.sort(key=lambda c: -c[0])
        level_nodes = []
        for score, parent, t in candidates[: shape.width]:
            token = vocab_ids[t] if vocab_ids is not None else t
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.scores.append(score)
            level_nodes.append(len(tree) - 1)
        if level + 1 == shape.depth:
            break
        frontier, probs = level_nodes, expand(tree, level_nodes)
    return prune(tree, shape.max_nodes)


def prune(tree: Tree, n: int) -> Tree:
    """The n likeliest nodes (by score), renumbered breadth-first."""
    keep = sorted(sorted(range(len(tree)), key=lambda i: -tree.scores[i])[:n])
    new = {old: i for i, old in enumerate(keep)}
    # A child's score is its parent's times a probability: no child outranks its parent.
    assert all(tree.parents[i] < 0 or tree.parents[i] in new for i in keep)
    return Tree(
        tokens=[tree.tokens[i] for i in keep],
        parents=[new.get(tree.parents[i], -1) for i in keep],
        scores=[tree.scores[i] for i in keep],
        origin=keep,
    )


def row_distributions(dist: Distribution, logits: mx.array, tree: Tree) -> mx.array:
    """The target's sampling distribution at the root and every node: each row follows its own
    path (the repetition penalty sees the path's ids, not the other branches')."""
    if not dist.needs_history:
        return dist.probs(logits, None, 0)
    rows = [dist.probs(logits[:1], None, 0)]
    for i in range(len(tree)):
        path = [tree.tokens[n] for n in tree.path(i)]
        rows.append(dist.probs(logits[i + 1 : i + 2], mx.array(path, dtype=mx.int32), len(path)))
    return mx.concatenate(rows)
