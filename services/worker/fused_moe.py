"""The fused mixture-of-experts layer: every MoE model's experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek, gpt-oss), optionally split across DP engines (expert parallelism).

Contract: ``FusedMoE`` holds every expert's SwiGLU stacked, ``gate_up_proj`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``down_proj`` [E, H, I], where ``I`` is this rank's shard
of the expert intermediate size under tensor parallelism. ``forward(x, weights, expert_ids)`` takes
the router's choice (``[T, k]`` routing weights and expert ids) and returns this rank's partial sum
``sum_k weights[t, k] * expert[expert_ids[t, k]](x[t])`` [T, H]; the MoE block all-reduces it
(once, with whatever else it adds). ``route`` is the softmax top-k router the models share;
``grouped_topk`` DeepSeek's (softmax or sigmoid scores, expert groups, a correction bias).

How it runs: the ``T * k`` (token, expert) assignments are sorted by expert (a stable argsort), the
tokens' rows gathered once in that order, and each projection is a grouped GEMM: one ``torch.mm``
per expert that has tokens, over its contiguous slice of the gathered rows, written into its slice of
one output. SiLU-and-mul then runs once over every row, the down projection is the second grouped
GEMM, each row is scaled by its routing weight and added back to its token (``index_add_``).

Grouped-GEMM options, measured with ``gridserve bench fused-moe --strategies --repeats 41`` on this
project's 2-core AVX-512 CPU (shared, busy), one torch thread, E = 128 experts, top 8, H = 512,
I = 256 (Qwen3-30B-A3B scaled down), ms per layer, medians of interleaved samples::

    dtype  batch  per-expert loop  mm on slices  torch._grouped_mm  padded bmm  oneDNN-packed experts
    fp32     1         2.29            1.66            2.10            6.63          1.55
    fp32    16        21.6            15.0            14.4            51.8          11.6
    fp32    64        42.1            30.5            29.8           106.8          19.1
    bf16     1         2.32            1.40            1.74            3.17            -
    bf16    16        19.5            12.8            12.1            35.7            -
    bf16    64        43.4            20.5            19.1            65.6            -

The layer is bound by reading the active experts' weights. ``mm`` on slices is used: fastest at
batch 1 (by 20-25%), within 2-7% of ``torch._grouped_mm`` (a private op, a loop of GEMMs on the
CPU) at 16 and 64 (runs on this machine vary by more), no private API, any dtype and device;
``bmm`` pays for padding every group and gathering the weights. Holding each expert's fp32
weights in oneDNN's blocked layout, as ``cpu_packed_linear`` holds the dense layers', would be
~1.5x faster at 16 and 64; not done yet (it needs the packed layout's load / sleep / weight-sync
handling for stacked experts).

On CUDA (and under ``GRIDSERVE_KERNELS=triton``, which the interpreter tests use on CPU) float
experts run both projections through the Triton grouped GEMM (``kernels/triton_ops/moe.py``): one
program per (row tile of one expert, block of output columns), each tile's expert read from a
table built on the device from the per-expert counts, so the layer never syncs with the host (no
``counts.tolist()``); the bias is added inside the kernel, the activation, routing-weight scaling
and ``index_add_`` stay the torch / dispatched ops above. ``GRIDSERVE_KERNELS=reference`` (or a
missing Triton) keeps the torch GEMMs on any device; int8 experts keep their own path.

Expert parallelism (``--enable-expert-parallel``, ``ParallelState.ep``): the layer holds only its
DP rank's contiguous ``experts`` (``E / DP`` of them; the loader skips the other experts' tensors).
``forward`` then dispatches and combines across the engines with all-gather + all-reduce, chosen
over an all-to-all as the simplest exchange that is correct on gloo (no reduce-scatter there): one
all-reduce (MAX) of the token count, all-gathers of the tokens ``[DP x T_max, H]`` and of their
routing ``[DP x T_max, 2k]``, this rank's experts run on the assignments that chose them, then an
all-reduce of the ``[DP x T_max, H]`` partial sums of which each rank keeps its own rows. Cost per
layer: ~2 x ``DP x T_max x H`` elements moved per rank and four collectives' latency (an all-to-all
would move ~2 x ``T x k x H / DP``: less at large prefill batches, the same order at decode's).
An engine with nothing to run calls ``dummy_step`` (the same collectives on zero tokens) so its
peers' steps complete; the collectives time out after 30 s (a dead peer fails the step).

Quantized experts (``--quantization int8``; ``quantization.quantize_model`` calls ``quantize`` with
the layer's prefix's method): each held expert's gate/up and down matrices become a dense layer's
``QuantizedWeight`` (int8: symmetric, one scale per output channel; ``quantization/experts.py``),
the float stacks are freed, and each grouped GEMM runs the dense path's int8 GEMM (on CPU the C++
int8 x int16 kernel) on every expert's slice of the sorted rows; routing, activation, biases and the
expert-parallel exchange are unchanged. Weights cannot be loaded into quantized experts (weight
sync): the checkpoint is loaded again instead.

Hooks for later models: ``bias=True`` adds per-expert biases (``gate_up_bias`` [E, 2I] inside
the GEMM, ``down_bias`` [E, H] on TP rank 0 only, so the all-reduce counts it once: gpt-oss), and
``activation`` replaces SiLU-and-mul over the ``[rows, 2I]`` gate/up output (gpt-oss's clamped
SwiGLU); gpt-oss's interleaved, transposed checkpoint layout loads with ``load_interleaved`` and its
router is ``topk_softmax`` (top-k logits, then their softmax).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Optional

import torch
from torch import nn

from gridserve.kernels import silu_and_mul
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.services.worker.quantization.experts import QuantizedExperts
from gridserve.shared import envs
from gridserve.shared.errors import FailedPreconditionError
from gridserve.shared.parallel import even_shard, expert_shard

logger = logging.getLogger(__name__)

# One projection of the sorted rows: (``"gate_up"`` / ``"down"``, rows, bias) -> [rows, N]
GroupedGemm = Callable[[str, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]

# A checkpoint's expert tensors: one expert's projection (``...experts.3.w1.weight``) or a stacked
# tensor (``...experts.gate_up_proj`` [E, 2I, H], ``...experts.down_proj`` [E, H, I]).
_EXPERT_TENSOR = re.compile(
    r"^(?P<module>.+\.experts)\."
    r"(?:(?P<expert>\d+)\.(?P<proj>\w+)\.weight|(?P<stacked>gate_up_proj|down_proj)(?P<bias>_bias)?)$"
)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids)``, each ``[tokens, top_k]``: softmax in fp32, top-k, and (``renormalize``)
    the kept probabilities scaled to sum to one. The weights stay fp32."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class FusedMoE(nn.Module):
    """Every expert's gated MLP, stacked, run as two grouped GEMMs over tokens sorted by expert.

    ``field`` names the config field of ``intermediate_size`` in the error when it does not split
    evenly across the TP ranks, ``experts_field`` that of ``num_experts`` when it does not split
    across the expert-parallel ranks. With expert parallelism (``state.ep``) the layer holds only
    its rank's experts (``experts``: a contiguous range of them). After ``quantize`` the float
    ``gate_up_proj`` / ``down_proj`` are gone (None) and ``gate_up_quantized`` / ``down_quantized``
    hold them; the biases stay float.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, state: ParallelState, *,
                 field: str = "moe_intermediate_size", bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
                 experts_field: str = "model.hf_config.num_experts") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ep = state.ep
        self.experts = expert_shard(num_experts, self.ep.size if self.ep else 1, self.ep.rank if self.ep else 0,
                                    experts_field)
        self.shard = even_shard(intermediate_size, state.tp_size, state.tp_rank, field)
        self.adds_down_bias = state.tp_rank == 0  # a replicated bias: one rank adds it before the all-reduce
        self.activation = activation
        inter, local = self.shard.size, self.experts.size
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, inter))
        self.gate_up_bias = nn.Parameter(torch.empty(local, 2 * inter)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(local, hidden_size)) if bias else None
        self.gate_up_quantized: Optional[QuantizedExperts] = None
        self.down_quantized: Optional[QuantizedExperts] = None
        self.activation_dtype = torch.float32  # the float weights' dtype, kept once they are quantized

    @property
    def quantization(self) -> Optional[str]:
        """The experts' quantization method, None while they are float."""
        return None if self.down_quantized is None else self.down_quantized.method

    @torch.no_grad()
    def quantize(self, method: str, group_size: int = 128, activations: bool = True,
                 activation_rows: int = 2, activation_group: int = 0) -> None:
        """Swap this rank's loaded float experts for their ``method`` form (each expert's matrices
        quantized as a dense layer's: int8 with one scale per output channel), freeing the floats."""
        settings = (method, group_size, activations, activation_rows, activation_group)
        self.activation_dtype = self.down_proj.dtype
        self.gate_up_quantized = QuantizedExperts.from_float(self.gate_up_proj.data, *settings)
        self.down_quantized = QuantizedExperts.from_float(self.down_proj.data, *settings)
        self.gate_up_proj = None
        self.down_proj = None

    def weight_bytes(self) -> int:
        """Bytes of the experts this rank holds, as held (float parameters, quantized values)."""
        quantized = [q for q in (self.gate_up_quantized, self.down_quantized) if q is not None]
        return (sum(p.numel() * p.element_size() for p in self.parameters())
                + sum(q.nbytes() for q in quantized))

    def holds(self, expert: int) -> bool:
        """Whether this rank holds ``expert`` (always, without expert parallelism)."""
        return self.experts.start <= expert < self.experts.end

    @torch.no_grad()  # inference only: the GEMMs write into slices of one output (``out=``)
    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert[expert_ids[t, k]](x[t])`` for every token ``t`` (this rank's part)."""
        if self.ep is not None:
            return self._expert_parallel(x, weights, expert_ids)
        return self._experts(x, weights, expert_ids)

    @torch.no_grad()
    def dummy_step(self) -> None:
        """This layer's expert-parallel collectives on zero tokens (an engine with nothing to run,
        so that its peers' steps complete)."""
        if self.ep is not None:
            weight = self.down_proj if self.down_proj is not None else self.down_quantized.weights[0].scales
            empty = torch.empty(0, self.hidden_size, dtype=self._activations_dtype(), device=weight.device)
            self._expert_parallel(empty, empty.new_empty(0, 0), empty.new_empty(0, 0, dtype=torch.long))

    def _activations_dtype(self) -> torch.dtype:
        return self.down_proj.dtype if self.down_proj is not None else self.activation_dtype

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """The grouped GEMMs over the assignments to this rank's experts; others are skipped."""
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        flat = expert_ids.flatten() - self.experts.start
        flat_weights = weights.flatten()
        mine = None
        if self.ep is not None:  # only this rank's experts (padding rows hold expert -1: nobody's)
            mine = ((flat >= 0) & (flat < self.experts.size)).nonzero().squeeze(1)
            flat, flat_weights = flat[mine], flat_weights[mine]
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, ascending
        tokens = (order if mine is None else mine[order]) // expert_ids.shape[1]
        gemm = self._grouped_gemm(x, torch.bincount(flat, minlength=self.experts.size), tokens.shape[0])
        rows = x[tokens]
        h = self.activation(gemm("gate_up", rows, self.gate_up_bias))
        down_bias = self.down_bias if self.adds_down_bias else None
        y = gemm("down", h, down_bias)
        # fp32 routing weights promote a half-precision product, rounded once (as transformers does)
        return out.index_add_(0, tokens, (y * flat_weights[order].unsqueeze(-1)).to(x.dtype))

    def _grouped_gemm(self, x: torch.Tensor, counts: torch.Tensor, num_rows: int) -> GroupedGemm:
        """This batch's grouped GEMM over ``num_rows`` sorted rows (``counts`` [experts] each): the
        Triton kernel for float experts on CUDA (or under ``GRIDSERVE_KERNELS=triton``), sharing one
        tile table between the projections and never syncing with the host; else ``_project``."""
        moe = _triton_moe(x) if self.down_quantized is None else None
        if moe is not None:
            tiles = moe.moe_tiles(counts, num_rows)

            def triton_gemm(projection: str, rows: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
                return moe.moe_grouped_gemm(rows, getattr(self, f"{projection}_proj"), counts, bias, tiles=tiles)

            return triton_gemm
        return functools.partial(self._project, counts=counts.tolist())

    def _project(self, projection: str, rows: torch.Tensor, bias: Optional[torch.Tensor],
                 counts: list[int]) -> torch.Tensor:
        """``rows`` grouped by expert through ``projection`` (``gate_up`` / ``down``), float or quantized."""
        quantized: Optional[QuantizedExperts] = getattr(self, f"{projection}_quantized")
        if quantized is None:
            return _grouped_mm(rows, getattr(self, f"{projection}_proj"), bias, counts)
        out_features = 2 * self.shard.size if projection == "gate_up" else self.hidden_size
        return quantized.grouped_mm(rows, bias, counts, out_features)

    def _expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Dispatch and combine across the DP engines: every rank's tokens gathered to every rank
        (padded to the most any rank has), each rank's experts run on the assignments they hold,
        the partial sums all-reduced and each rank keeps its own rows."""
        ep, tokens = self.ep, x.shape[0]
        most, top_k = ep.max_of([tokens, expert_ids.shape[1]], x.device)  # a dummy step learns k
        if most == 0:
            return torch.zeros_like(x)
        pad = most - tokens
        # ids travel beside the weights (float64 holds both exactly); padding rows route to expert -1
        routing = torch.cat([weights.double().reshape(tokens, top_k), expert_ids.double().reshape(tokens, top_k)], 1)
        routing = nn.functional.pad(routing, (0, 0, 0, pad), value=-1.0)
        every_x = ep.all_gather(nn.functional.pad(x, (0, 0, 0, pad)))
        every_routing = ep.all_gather(routing)
        weight_dtype = weights.dtype if tokens else torch.float32
        out = self._experts(every_x, every_routing[:, :top_k].to(weight_dtype), every_routing[:, top_k:].long())
        ep.all_reduce(out)
        return out[ep.rank * most : ep.rank * most + tokens]

    # ---- loading: this rank's slice of each checkpoint tensor
    def load_expert(self, expert: int, part: str, tensor: CheckpointTensor) -> str:
        """This rank's slice of one expert's ``gate``, ``up`` or ``down`` matrix (an expert it
        ``holds``); returns the parameter's name."""
        s = self.shard
        expert -= self.experts.start
        self._check_float()
        if part == "down":
            self.down_proj.data[expert].copy_(tensor.cols(s.start, s.end))
            return "down_proj"
        offset = 0 if part == "gate" else s.size
        self.gate_up_proj.data[expert, offset : offset + s.size].copy_(tensor.rows(s.start, s.end))
        return "gate_up_proj"

    def load_stacked(self, name: str, tensor: CheckpointTensor) -> str:
        """This rank's slice of a stacked ``gate_up_proj`` / ``down_proj`` (or its ``_bias``); returns
        the name of the parameter it went into."""
        s, tensor = self.shard, self._held_experts(tensor)
        self._check_float()
        if name == "down_proj":
            self.down_proj.data.copy_(tensor.narrow(2, s.start, s.end))
            return name
        if name == "down_proj_bias":
            self.down_bias.data.copy_(tensor.full())
            return "down_bias"
        param = "gate_up_proj" if name == "gate_up_proj" else "gate_up_bias"
        target = getattr(self, param).data
        target[:, : s.size].copy_(tensor.narrow(1, s.start, s.end))
        target[:, s.size :].copy_(tensor.narrow(1, s.total + s.start, s.total + s.end))
        return param

    def load_interleaved(self, name: str, tensor: CheckpointTensor) -> str:
        """This rank's slice of gpt-oss's stacked experts, stored for ``x @ W``: ``gate_up_proj``
        [E, H, 2I] whose columns alternate gate and up (``[..., ::2]`` / ``[..., 1::2]``), its
        ``_bias`` [E, 2I] likewise, ``down_proj`` [E, I, H] and ``down_proj_bias`` [E, H]; returns
        the name of the parameter it went into."""
        s, tensor = self.shard, self._held_experts(tensor)
        self._check_float()
        if name == "down_proj":
            self.down_proj.data.copy_(tensor.narrow(1, s.start, s.end).transpose(1, 2))
            return name
        if name == "down_proj_bias":
            self.down_bias.data.copy_(tensor.full())
            return "down_bias"
        if name == "gate_up_proj":
            pairs = tensor.narrow(2, 2 * s.start, 2 * s.end).transpose(1, 2)  # [E, 2 x shard, H]
            param = "gate_up_proj"
        else:
            pairs = tensor.narrow(1, 2 * s.start, 2 * s.end)  # [E, 2 x shard]
            param = "gate_up_bias"
        target = getattr(self, param).data
        target[:, : s.size].copy_(pairs[:, 0::2])
        target[:, s.size :].copy_(pairs[:, 1::2])
        return param

    def _check_float(self) -> None:
        if self.quantization is not None:
            raise FailedPreconditionError(f"the experts are quantized ({self.quantization}): float weights "
                                          "cannot be loaded into them; load the checkpoint again instead")

    def _held_experts(self, tensor: CheckpointTensor) -> CheckpointTensor:
        """A stacked tensor's rows of this rank's experts (read lazily: the others' stay unread)."""
        if self.experts.size == self.num_experts:
            return tensor
        return tensor.row_block(self.experts.start, self.experts.end)


def expert_parallel_dummy_step(model: Optional[nn.Module]) -> None:
    """A step that runs no tokens under expert parallelism: every MoE layer's collectives on zero
    tokens, in model order, so that the peers' steps (which wait on them) complete. No-op without."""
    for module in model.modules() if model is not None else ():
        if isinstance(module, FusedMoE) and module.ep is not None:
            module.dummy_step()


def expert_parameter_bytes(model: nn.Module) -> tuple[int, str]:
    """Bytes of the routed experts' parameters this rank holds, and which experts (``"experts
    [0, 4) of 8"``; empty for a dense model)."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    total = sum(m.weight_bytes() for m in layers)
    held = f"experts [{layers[0].experts.start}, {layers[0].experts.end}) of {layers[0].num_experts}" if layers else ""
    return total, held


@functools.lru_cache(maxsize=1)
def _triton_moe_module():
    """``kernels.triton_ops.moe``, or None when Triton (or its kernels) cannot be imported."""
    try:
        from gridserve.kernels.triton_ops import moe
    except ImportError as exc:
        logger.info("Triton MoE kernel unavailable (%s); experts run torch GEMMs", exc)
        return None
    return moe


def _triton_moe(x: torch.Tensor):
    """The Triton grouped-GEMM module for activations ``x``, chosen as ``gridserve.kernels.dispatch``
    chooses Triton (``GRIDSERVE_KERNELS``: CUDA tensors under ``auto`` / ``cpu``, any tensor under
    ``triton``, never under ``reference``), or None for the torch GEMMs."""
    mode = envs.GRIDSERVE_KERNELS
    if mode == "reference" or not (x.is_cuda or mode == "triton"):
        return None
    moe = _triton_moe_module()
    if moe is None and mode == "triton":
        raise RuntimeError("GRIDSERVE_KERNELS=triton but the Triton MoE kernel cannot be imported")
    return moe


def _grouped_mm(a: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                counts: list[int]) -> torch.Tensor:
    """Rows of ``a`` grouped by expert (``counts[e]`` rows each, in order) times their expert's
    ``weight[e].T`` (plus ``bias[e]``): one GEMM per expert with rows, into one output."""
    out = a.new_empty(a.shape[0], weight.shape[1])
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        if bias is None:
            torch.mm(a[start:end], weight[expert].t(), out=out[start:end])
        else:
            torch.addmm(bias[expert], a[start:end], weight[expert].t(), out=out[start:end])
        start = end
    return out


class ExpertTensors:
    """Takes a checkpoint's expert tensors out of its stream into the model's ``FusedMoE`` layers.

    ``parts`` names one expert's matrices by their checkpoint names (Mixtral: ``{"w1": "gate", "w3":
    "up", "w2": "down"}``); the stacked layout (transformers 5's in-memory one) loads too. ``place``
    is the model's ``_target``: None for a tensor of another pipeline stage (left unread).
    ``loaded`` holds the parameters filled once ``others`` has been consumed.
    """

    def __init__(self, model: nn.Module, parts: Mapping[str, str],
                 place: Callable[[str], Optional[str]]) -> None:
        self.model = model
        self.parts = parts
        self.place = place
        self.loaded: set[str] = set()

    def others(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        """Every tensor that is not an expert's, in order; the experts' are loaded on the way (an
        expert another expert-parallel rank holds is left unread)."""
        for name, tensor in weights:
            match = _EXPERT_TENSOR.match(name)
            if match is None or (match["proj"] is not None and match["proj"] not in self.parts):
                yield name, tensor
            elif self.place(name) is not None and self._held(match):
                self.loaded.add(self._load(match, tensor))

    def _held(self, match: re.Match) -> bool:
        if match["expert"] is None:  # stacked: the layer reads its experts' rows
            return True
        experts: FusedMoE = self.model.get_submodule(match["module"])
        return experts.holds(int(match["expert"]))

    def _load(self, match: re.Match, tensor: CheckpointTensor) -> str:
        module = match["module"]
        experts: FusedMoE = self.model.get_submodule(module)
        if match["stacked"]:
            param = experts.load_stacked(match["stacked"] + (match["bias"] or ""), tensor)
        else:
            param = experts.load_expert(int(match["expert"]), self.parts[match["proj"]], tensor)
        return f"{module}.{param}"


class InterleavedExpertTensors(ExpertTensors):
    """``ExpertTensors`` for gpt-oss's stacked layout (``FusedMoE.load_interleaved``)."""

    def __init__(self, model: nn.Module, place: Callable[[str], Optional[str]]) -> None:
        super().__init__(model, {}, place)

    def _load(self, match: re.Match, tensor: CheckpointTensor) -> str:
        module = match["module"]
        experts: FusedMoE = self.model.get_submodule(module)
        return f"{module}.{experts.load_interleaved(match['stacked'] + (match['bias'] or ''), tensor)}"


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router: ``(weights, expert_ids)``, each ``[tokens, top_k]``: the top-k logits, then
    the softmax over those k only (in the logits' dtype, as transformers' ``GptOssTopKRouter``)."""
    values, expert_ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1), expert_ids


def grouped_topk(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", n_group: int = 1,
                 topk_group: int = 1, group_score: str = "max",
                 correction_bias: Optional[torch.Tensor] = None, renormalize: bool = False,
                 scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's router: ``(weights, expert_ids)``, each ``[tokens, top_k]``, weights in fp32.

    ``scoring`` turns the logits into scores: ``softmax`` (V2) or ``sigmoid`` (V3). The experts are
    chosen on the scores plus ``correction_bias`` (V3's ``e_score_correction_bias``; None: none),
    first among groups: the ``n_group`` equal groups of consecutive experts are ranked by
    ``group_score`` (``max``: the best expert, V2's ``group_limited_greedy``; ``top2_sum``: the two
    best, V3's ``noaux_tc``) and only the best ``topk_group`` groups' experts may be chosen
    (``n_group=1``: plain top-k, V2's ``greedy``). The weights are the chosen experts' scores
    *without* the bias, scaled to sum to one when ``renormalize`` (``+1e-20``, as transformers), then
    times ``scaling_factor`` (``routed_scaling_factor``). Ties go to the lower group / expert index.
    """
    scores = torch.softmax(router_logits.float(), dim=-1) if scoring == "softmax" else router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)
        if group_score == "max":
            per_group = grouped.max(dim=-1).values
        else:
            per_group = _topk(grouped, 2)[0].sum(dim=-1)
        groups = _topk(per_group, topk_group)[1]
        keep = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
        choice = choice.masked_fill(~keep, float("-inf"))
    expert_ids = _topk(choice, top_k)[1]
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, expert_ids


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest along the last dimension and their indices, ties to the lower index."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]
