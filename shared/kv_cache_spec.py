"""What each layer keeps in the KV cache (reported by the workers) and the plan the engine makes.

A worker reports one ``LayerKVCacheSpec`` per attention layer it holds (``get_kv_cache_spec``): its
kind, this rank's bytes per token and, for a window layer, the window. The engine merges every
rank's report (tensor-parallel ranks report the same layers, pipeline stages their own) and groups
the layers (``plan_kv_cache``):

* layers of one kind form one **KV cache group**; each group has its own block table per request
  (``NewRequestData.block_ids[g]``), so a sliding-window group can free the blocks its window no
  longer sees while the full-attention group keeps every token;
* when a model mixes kinds, every group has the same number of layers (``group_size``; a kind with
  more layers is split into several groups), and the worker allocates ``group_size`` *slot*
  tensors: layer ``i`` of every group uses slot ``i``. One block id therefore means the same memory
  in every group, and all groups draw from one pool of ``num_blocks`` blocks (vLLM's hybrid
  allocator). A model of one kind has a single group whose layers each have a slot: today's layout;
* the pool is sized from the largest rank's bytes per block (the sum of its slots' page sizes).

Kinds: ``full`` (K and V of every token), ``sliding_window`` (K and V of the last ``sliding_window``
tokens a query can see), ``mla`` (one compressed latent + the rope part per token: multi-head latent
attention, DeepSeek), ``none`` (a layer that keeps nothing). A speculative draft model's layers are
reported by the same worker under their own names and grouped like any others.

Torch-free: the engine and the wire use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from gridserve.shared.errors import ConfigError

FULL = "full"
SLIDING_WINDOW = "sliding_window"
MLA = "mla"
NONE = "none"
KINDS = (FULL, SLIDING_WINDOW, MLA, NONE)


@dataclass(frozen=True)
class LayerKVCacheSpec:
    """One layer's KV cache on one rank."""

    layer_name: str  # the module's name ("model.layers.3.self_attn.attn"): the same on every rank
    kind: str
    block_size: int
    bytes_per_token: int  # this rank's bytes per token (K + V, or the latent); 0 for ``none``
    sliding_window: int = 0  # tokens a query sees (``sliding_window`` kind only)
    num_kv_heads: int = 0  # this rank's KV heads (attention kinds)
    head_size: int = 0
    kv_lora_rank: int = 0  # the latent's width (``mla``)
    qk_rope_head_dim: int = 0  # the rope part stored beside it (``mla``)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.layer_name}: unknown KV cache kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.block_size < 1 or self.bytes_per_token < 0:
            raise ValueError(f"{self.layer_name}: block_size must be positive and bytes_per_token non-negative")
        if (self.kind == SLIDING_WINDOW) != (self.sliding_window > 0):
            raise ValueError(f"{self.layer_name}: a sliding_window layer needs a positive window, no other kind has one")

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of this layer on this rank."""
        return self.bytes_per_token * self.block_size

    @property
    def group_key(self) -> tuple[str, int]:
        """Layers with equal keys share a group (same kind, same window)."""
        return self.kind, self.sliding_window

    @property
    def shape_key(self) -> tuple[int, ...]:
        """Layers that share a slot tensor must have equal shapes."""
        return self.num_kv_heads, self.head_size, self.kv_lora_rank, self.qk_rope_head_dim, self.bytes_per_token


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one kind that share a block table."""

    kind: str
    layer_names: tuple[str, ...]
    sliding_window: int = 0

    @property
    def name(self) -> str:
        """How metrics and the status name it: ``full``, ``sliding_window_4096``, ``mla``."""
        return f"{SLIDING_WINDOW}_{self.sliding_window}" if self.kind == SLIDING_WINDOW else self.kind


@dataclass
class KVCacheConfig:
    """The engine's plan: the pool's size and the groups (every rank gets the same plan)."""

    num_blocks: int  # blocks in the pool, the null block (id 0) included
    block_size: int
    groups: tuple[KVCacheGroup, ...]
    bytes_per_block: int = 0  # the largest rank's bytes for one block id (all its slots)
    # layer name -> (group index, slot index); derived from ``groups``
    slots: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.slots = {name: (g, i) for g, group in enumerate(self.groups) for i, name in enumerate(group.layer_names)}

    @property
    def windows(self) -> tuple[int, ...]:
        """Each group's window (0: the group keeps every token)."""
        return tuple(g.sliding_window if g.kind == SLIDING_WINDOW else 0 for g in self.groups)


def single_group(num_blocks: int, block_size: int, layer_names: Sequence[str] = ()) -> KVCacheConfig:
    """Every layer full attention in one group: the plan of a model of one kind (and of tests)."""
    return KVCacheConfig(num_blocks, block_size, (KVCacheGroup(FULL, tuple(layer_names)),))


def as_full(spec: LayerKVCacheSpec) -> LayerKVCacheSpec:
    """A window layer's spec as full attention (every token kept); other kinds unchanged."""
    return replace(spec, kind=FULL, sliding_window=0) if spec.kind == SLIDING_WINDOW else spec


def merge_rank_specs(rank_specs: Sequence[Sequence[LayerKVCacheSpec]]) -> list[LayerKVCacheSpec]:
    """Every layer once, in rank order (pipeline stages in order give the model's layer order); a
    layer several ranks report (tensor parallelism) must agree on its kind and window."""
    merged: dict[str, LayerKVCacheSpec] = {}
    for specs in rank_specs:
        for spec in specs:
            seen = merged.get(spec.layer_name)
            if seen is None:
                merged[spec.layer_name] = spec
            elif seen.group_key != spec.group_key or seen.block_size != spec.block_size:
                raise ConfigError("model", f"ranks disagree on the KV cache of {spec.layer_name}: "
                                           f"{seen.group_key} vs {spec.group_key}")
    return list(merged.values())


def group_layers(specs: Sequence[LayerKVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Groups of one kind each; with several kinds, every group holds ``group_size`` layers (the
    smallest kind's count) except a kind's last, so that slot ``i`` of every group is one tensor."""
    by_key: dict[tuple[str, int], list[LayerKVCacheSpec]] = {}
    for spec in specs:
        if spec.kind != NONE:
            by_key.setdefault(spec.group_key, []).append(spec)
    if not by_key:
        raise ConfigError("model", "no layer of the model keeps a KV cache")
    if len(by_key) == 1:
        (kind, window), layers = next(iter(by_key.items()))
        return (KVCacheGroup(kind, tuple(s.layer_name for s in layers), window),)
    shapes = {s.shape_key for layers in by_key.values() for s in layers}
    if len(shapes) > 1:
        raise ConfigError("model", "the model mixes KV cache kinds whose layers differ in shape "
                                   f"({len(shapes)} shapes): one pool of blocks needs one page shape")
    group_size = min(len(layers) for layers in by_key.values())
    groups = []
    for (kind, window), layers in by_key.items():
        names = [s.layer_name for s in layers]
        for start in range(0, len(names), group_size):
            groups.append(KVCacheGroup(kind, tuple(names[start:start + group_size]), window))
    return tuple(groups)


def rank_bytes_per_block(specs: Sequence[LayerKVCacheSpec], groups: Sequence[KVCacheGroup]) -> int:
    """One block id's bytes on a rank: the page of every slot tensor the rank allocates."""
    slots = {name: i for group in groups for i, name in enumerate(group.layer_names)}
    pages: dict[int, int] = {}
    for spec in specs:
        if spec.layer_name in slots:
            slot = slots[spec.layer_name] if len(groups) > 1 else len(pages)
            pages[slot] = max(pages.get(slot, 0), spec.page_bytes)
    return sum(pages.values())


def plan_kv_cache(rank_specs: Sequence[Sequence[LayerKVCacheSpec]], available_bytes: int, block_size: int,
                  max_model_len: int, hybrid: bool = True) -> KVCacheConfig:
    """The groups and the pool that fits ``available_bytes`` (the least any rank has) on every rank;
    refused when one request of ``max_model_len`` tokens could not fit in every group. Without
    ``hybrid``, window layers are planned as full attention (they keep every token)."""
    if block_size < 1:
        raise ConfigError("cache.block_size", f"must be a positive integer, got {block_size}")
    if not hybrid:
        rank_specs = [[as_full(s) for s in specs] for specs in rank_specs]
    groups = group_layers(merge_rank_specs(rank_specs))
    bytes_per_block = max(rank_bytes_per_block(specs, groups) for specs in rank_specs)
    if bytes_per_block < 1:
        raise ConfigError("model", "the workers report no KV cache bytes")
    num_blocks = num_blocks_for_memory(available_bytes, bytes_per_block // block_size, block_size)
    needed = len(groups) * math.ceil(max_model_len / block_size)
    if num_blocks - 1 < needed:
        raise ConfigError(
            "cache.kv_cache_memory_bytes",
            f"the KV cache holds {num_blocks - 1} blocks of {block_size} tokens; one request of "
            f"max_model_len={max_model_len} needs {needed} ({len(groups)} group(s)); give it more memory "
            "or lower max_model_len",
        )
    return KVCacheConfig(num_blocks, block_size, groups, bytes_per_block)


def num_blocks_for_memory(kv_cache_memory_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """How many blocks (the null block included) fit in ``kv_cache_memory_bytes``."""
    if bytes_per_token < 1:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    if block_size < 1:
        raise ConfigError("cache.block_size", f"must be a positive integer, got {block_size}")
    bytes_per_block = bytes_per_token * block_size
    num_blocks = kv_cache_memory_bytes // bytes_per_block
    if num_blocks < 2:
        raise ConfigError(
            "cache.kv_cache_memory_bytes",
            f"{kv_cache_memory_bytes} bytes hold {num_blocks} blocks of {bytes_per_block} bytes; "
            f"at least 2 are needed (one is the null block), i.e. {2 * bytes_per_block} bytes",
        )
    return num_blocks


def num_skipped_blocks(window: int, num_computed_tokens: int, block_size: int) -> int:
    """Leading blocks a window group no longer needs once ``num_computed_tokens`` are in the cache:
    the next token (position ``num_computed_tokens``) sees positions from ``num_computed_tokens -
    window + 1`` on, so every block wholly before that is done. 0 without a window."""
    if window <= 0:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size
