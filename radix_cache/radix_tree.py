"""RadixAttention's prefix tree: token sequences on the edges, their KV slots in the nodes.

Invariants the code keeps (and the tests check):
- every node but the root has a non-empty key, and `len(node.key) == len(node.slots)`;
- children are keyed by the first token of their key, so siblings never share a first token;
- `node.lock_ref` counts the locks on paths through the node, so a parent's count is at least its
  child's and an unlocked node has an unlocked subtree;
- all tokens of one node share one access time (a partial touch splits the node first), and a
  parent was touched no earlier than its children;
- `_evictable` and `_protected` equal the key lengths summed over unlocked and locked nodes.

Eviction pops a heap of (access time, leaf) entries. Entries are never removed in place: one goes
stale when its node is touched, locked, given a child or evicted, and is skipped when popped. A new
entry is pushed whenever a node becomes an unlocked leaf or is touched as one. The heap is rebuilt
from its live entries when it grows past twice the node count, so stale entries cost O(1) amortized.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from .base import InsertResult, MatchResult, PrefixCache


class TreeNode:
    __slots__ = ("key", "slots", "parent", "children", "lock_ref", "last_access")

    def __init__(
        self,
        key: tuple[int, ...],
        slots: torch.Tensor,
        parent: TreeNode | None,
        last_access: int,
    ) -> None:
        self.key = key
        self.slots = slots  # (len(key),) int64
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = last_access

    def __repr__(self) -> str:
        return (
            f"TreeNode(key={self.key!r}, lock_ref={self.lock_ref}, last_access={self.last_access})"
        )


class RadixCache(PrefixCache):
    """A radix tree over KV slots, page size 1; see `PrefixCache` for the contract."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._clock = itertools.count(1)  # access times: deterministic, unlike wall time
        self._seq = itertools.count()  # heap tie-breaker, so nodes are never compared
        # The root outlives `reset`, so an empty match taken before one stays a valid handle.
        self._root = TreeNode((), self._empty, None, 0)
        self._init_tree()

    def _init_tree(self) -> None:
        self._root.children = {}
        self._num_nodes = 0  # excluding the root
        self._evictable = 0
        self._protected = 0
        self._heap: list[tuple[int, int, TreeNode]] = []

    @property
    def root(self) -> TreeNode:
        return self._root

    # ---- queries and inserts ----

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        key = _as_key(tokens)
        node, _, parts = self._walk(key)
        return MatchResult(self._cat(parts), node)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> InsertResult:
        key = _as_key(tokens)
        if slots.dim() != 1 or slots.numel() != len(key):
            raise ValueError(
                f"insert needs one slot per token: got {len(key)} tokens and slots of shape "
                f"{tuple(slots.shape)}"
            )
        node, prefix_len, _ = self._walk(key)
        if prefix_len < len(key):
            # A copy: the caller's tensor is often a view of its req_to_token row, reused later.
            own = slots[prefix_len:].to(self.device, torch.int64, copy=True)
            child = TreeNode(key[prefix_len:], own, node, node.last_access)
            node.children[child.key[0]] = child
            self._num_nodes += 1
            self._evictable += len(child.key)  # new nodes are unlocked, even under a locked parent
            node = child
            self._push_if_evictable_leaf(node)
        return InsertResult(prefix_len, node)

    def _walk(self, key: tuple[int, ...]) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `key` from the root, splitting the last node if the match ends inside it, and
        touch the path. Returns the node ending the match, its length and the path's slots."""
        now = next(self._clock)
        node = self._root
        node.last_access = now
        pos = 0
        parts: list[torch.Tensor] = []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                # The next lookup fails (mismatch or end of key), so the loop ends at the split.
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.slots)
            pos += n
            node = child
        self._push_if_evictable_leaf(node)
        return node, pos, parts

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node` after its first n tokens; return the new upper part. The lower part keeps its
        identity, so a handle to it still stands for the same path (and keeps its locks)."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.key)  # internal invariant
        upper = TreeNode(node.key[:n], node.slots[:n], parent, node.last_access)
        upper.lock_ref = node.lock_ref
        upper.children[node.key[n]] = node
        parent.children[upper.key[0]] = upper
        node.key = node.key[n:]
        node.slots = node.slots[n:]
        node.parent = upper
        self._num_nodes += 1
        return upper

    # ---- locks ----

    def lock(self, node: TreeNode) -> None:
        for n in self._path(node):
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        path = self._path(node)
        if path and node.lock_ref == 0:
            raise RuntimeError("unlock of a node that is not locked (unbalanced lock/unlock)")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected -= len(n.key)
                self._evictable += len(n.key)
        self._push_if_evictable_leaf(node)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """The nodes from `node` up to (not including) the root; empty for the root."""
        path = []
        n: TreeNode | None = node
        while n is not self._root:
            if not isinstance(n, TreeNode):
                raise RuntimeError(
                    "node is not in this cache (evicted, reset, or from another cache)"
                )
            path.append(n)
            n = n.parent
        return path

    # ---- eviction ----

    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens and self._heap:
            when, _, node = heapq.heappop(self._heap)
            if when != node.last_access or not self._is_evictable_leaf(node):
                continue  # stale entry
            parent = node.parent
            assert parent is not None  # live nodes have parents
            del parent.children[node.key[0]]
            node.parent = None
            self._num_nodes -= 1
            self._evictable -= len(node.key)
            count += len(node.key)
            freed.append(node.slots)
            self._push_if_evictable_leaf(parent)
        return self._cat(freed)

    def reset(self) -> torch.Tensor:
        if self._protected:
            raise RuntimeError(
                f"cannot reset the prefix cache: {self._protected} slots are locked by running "
                "requests"
            )
        parts: list[torch.Tensor] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            parts.append(node.slots)
            stack.extend(node.children.values())
            node.parent = None  # stale handles now fail in lock/unlock
        self._init_tree()
        return self._cat(parts)

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _push_if_evictable_leaf(self, node: TreeNode) -> None:
        if not self._is_evictable_leaf(node):
            return
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        live: dict[int, tuple[int, int, TreeNode]] = {}
        for entry in self._heap:
            when, _, node = entry
            if when == node.last_access and self._is_evictable_leaf(node):
                live[id(node)] = entry
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    # ---- sizes and debugging ----

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    def __len__(self) -> int:
        """Cached tokens (= slots owned)."""
        return self._evictable + self._protected

    def pretty(self) -> str:
        """The tree as indented text, one node a line, for debugging."""
        lines: list[str] = []

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(
                    f"{'  ' * depth}{list(child.key)} slots={child.slots.tolist()} "
                    f"lock={child.lock_ref} t={child.last_access}"
                )
                visit(child, depth + 1)

        visit(self._root, 0)
        return "\n".join(lines)

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else self._empty


def _as_key(tokens: Sequence[int]) -> tuple[int, ...]:
    if isinstance(tokens, torch.Tensor):
        return tuple(tokens.tolist())
    return tokens if isinstance(tokens, tuple) else tuple(tokens)


def _common_len(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]`."""
    segment = tokens[start : start + len(key)]
    if segment == key:  # the usual case: the whole edge matches (one C-level compare)
        return len(key)
    for i, (a, b) in enumerate(zip(key, segment)):
        if a != b:
            return i
    return len(segment)  # tokens end inside the key
