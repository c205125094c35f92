"""Shard arithmetic of tensor and pipeline parallelism (no torch: the engine sizes the KV cache with it).

Ranks are laid out pipeline-major, as in vLLM: ``rank = pp_rank * tp_size + tp_rank``. The TP group
of a rank is the ``tp_size`` consecutive ranks of its stage; its PP group is every rank with the
same ``tp_rank``. The output rank (the one whose ``execute_model`` result the engine waits for) is
TP rank 0 of the last stage.

Expert parallelism (``--enable-expert-parallel``) adds a DP-wide world, ``rank = dp_rank * tp_size +
tp_rank``; each DP rank holds a contiguous ``expert_shard`` of every MoE layer's experts.

Every helper returns ``Shard(start, size)`` ranges into the full (unsharded) dimension, so the loader
can read exactly that slice of each checkpoint tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from gridserve.shared.errors import ConfigError


@dataclass(frozen=True)
class Shard:
    """``size`` entries starting at ``start`` of a dimension of length ``total``."""

    start: int
    size: int
    total: int

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class RankLayout:
    """Where one global rank sits in the ``PP x TP`` grid."""

    rank: int
    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        return self.rank == output_rank(self.tp_size, self.pp_size)

    def tp_group_ranks(self) -> list[int]:
        return tp_group_ranks(self.tp_size, self.pp_size)[self.pp_rank]

    def pp_group_ranks(self) -> list[int]:
        return pp_group_ranks(self.tp_size, self.pp_size)[self.tp_rank]


def output_rank(tp_size: int, pp_size: int) -> int:
    """The global rank that returns sampled tokens: TP rank 0 of the last stage."""
    return (pp_size - 1) * tp_size


def tp_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    """Every TP group, one per stage."""
    return [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(pp_size)]


def pp_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    """Every PP group, one per TP rank."""
    return [[s * tp_size + t for s in range(pp_size)] for t in range(tp_size)]


def even_shard(total: int, tp_size: int, tp_rank: int, what: str = "dimension") -> Shard:
    """An evenly divisible dimension (heads, intermediate size) split across TP ranks."""
    if total % tp_size:
        raise ConfigError("parallel.tensor_parallel_size", f"{what} ({total}) is not divisible by {tp_size}")
    size = total // tp_size
    return Shard(tp_rank * size, size, total)


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> Shard:
    """This rank's rows of the vocabulary; every rank holds ``ceil(V / tp)`` rows (the last may pad)."""
    per_rank = padded_vocab_rows(vocab_size, tp_size)
    start = min(tp_rank * per_rank, vocab_size)
    return Shard(start, min(per_rank, vocab_size - start), vocab_size)


def padded_vocab_rows(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size)


def kv_head_shard(num_kv_heads: int, tp_size: int, tp_rank: int) -> Shard:
    """KV heads of this rank: split when there are at least ``tp`` of them, else one replicated head.

    With fewer KV heads than ranks, ``tp / num_kv_heads`` consecutive ranks share (replicate) one
    KV head, matching the query heads they hold.
    """
    if num_kv_heads >= tp_size:
        return even_shard(num_kv_heads, tp_size, tp_rank, "num_key_value_heads")
    if tp_size % num_kv_heads:
        raise ConfigError(
            "parallel.tensor_parallel_size",
            f"{tp_size} is not a multiple of num_key_value_heads ({num_kv_heads})",
        )
    return Shard(tp_rank // (tp_size // num_kv_heads), 1, num_kv_heads)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> Shard:
    """Layers of a pipeline stage: an even split, the first ``num_layers % pp`` stages get one more."""
    if num_layers < pp_size:
        raise ConfigError(
            "parallel.pipeline_parallel_size", f"{pp_size} stages for only {num_layers} layers"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return Shard(start, base + (1 if pp_rank < extra else 0), num_layers)


def check_model_shardable(hf_config: dict, tp_size: int, pp_size: int) -> None:
    """Refuse, naming the field, a model that cannot be split ``tp`` x ``pp`` ways."""
    heads = int(hf_config.get("num_attention_heads", 0) or 0)
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    if tp_size > 1:
        even_shard(heads, tp_size, 0, "num_attention_heads")
        kv_head_shard(kv_heads, tp_size, 0)
        for name in ("intermediate_size", "ffn_dim"):
            if name in hf_config:
                even_shard(int(hf_config[name]), tp_size, 0, name)
    stage_layers(int(hf_config.get("num_hidden_layers", 0) or 0), pp_size, 0)


# ---- expert parallelism ----------------------------------------------------------------------------
def expert_parallel_rank(dp_rank: int, tp_size: int, tp_rank: int) -> int:
    """A worker's rank in the DP-wide expert-parallel world (``dp_rank * TP + tp_rank``; PP is 1)."""
    return dp_rank * tp_size + tp_rank


def expert_shard(num_experts: int, ep_size: int, ep_rank: int, field: str) -> Shard:
    """The contiguous experts an expert-parallel rank holds: ``num_experts / ep_size`` of them.

    ``field`` names the config field of the expert count in the error when it does not divide."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert-parallel rank {ep_rank} of {ep_size}")
    if num_experts % ep_size:
        raise ConfigError(field, f"{num_experts} experts do not split evenly across {ep_size} "
                                 f"expert-parallel ranks (data_parallel_size with --enable-expert-parallel)")
    size = num_experts // ep_size
    return Shard(ep_rank * size, size, num_experts)
