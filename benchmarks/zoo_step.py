"""``gridserve bench zoo-step``: one decode step of every built-in architecture, per FLOP, against Llama's.

Every text architecture of ``shared/model_registry.py``'s ``ARCHITECTURES`` (Llava, the one
multimodal entry, left out; the MoEs in, counted by their active experts) is built as a tiny random
checkpoint of **one shape family**: hidden 256, 4 layers, 4 heads of 64 (MHA), vocab 4096, 1024
positions, and an MLP of about the same weights whatever its form (intermediate 688 for a gated
MLP's three matrices, 1024 = 4 x hidden for a plain MLP's two; Mixtral, Qwen3-MoE and gpt-oss: 4
experts of 344, top 2; Qwen2-MoE: 4 experts of 172, top 2, and a shared expert of 344).
Each architecture keeps its other knobs at transformers' defaults (tied or untied LM head, partial
rotary, parallel residual, ALiBi, soft caps, Q/K norms...). Checkpoints are built with
transformers' own config class and ``AutoModelForCausalLM.from_config`` plus the recipe's
tokenizer, cached under ``<model cache>/zoo-bench/``.

The step is ``gridserve bench step``'s (``engine.step_overhead``): B running requests (prompts of
``--input-len-min``..``--input-len-max`` random tokens, the same for every architecture), prefilled,
3 warm-up decode steps, then the median wall time of ``--steps`` whole engine steps, of the
model forward + LM head inside them, and of the attention layers and the LM head (``compute_logits``,
soft cap and logit scale included) inside those; one torch thread by default (``--cpu-threads``).

FLOPs per decode step: ``2 x W x B`` for the matmuls, where W counts the weight matrices a token
multiplies (every 2-D parameter except the embedding tables it only looks up; the LM head always,
tied or not; a MoE's experts scaled by top-k / experts), plus attention
``4 x sum(ctx) x heads x head_dim x layers`` (QK^T and PV over each sequence's context, the new
token included; every window here is longer than the contexts). The figure to read is
``(ms / GFLOP) / Llama's``: 1.00 is as fast per FLOP as Llama, above is slower. Each round
measures Llama before and after every other architecture (A B A C A ...; every other round in
reverse order), each ratio against the mean of the two Llama steps around it; the table gives
the medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

HIDDEN, LAYERS, HEADS, HEAD_DIM, VOCAB, POSITIONS = 256, 4, 4, 64, 4096, 1024
GATED_MLP, PLAIN_MLP = 688, 4 * HIDDEN  # 3 x 256 x 688 ~ 2 x 256 x 1024 weights
BASELINE = "LlamaForCausalLM"
CACHE_FOLDER = "zoo-bench"

# the Llama-style names most configs take
_LLAMA_NAMES = {"hidden_size": HIDDEN, "intermediate_size": GATED_MLP, "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
                "max_position_embeddings": POSITIONS}
# plain-MLP configs with Llama-style names
_PLAIN_NAMES = {**_LLAMA_NAMES, "intermediate_size": PLAIN_MLP}
# ``bench step``'s shape reader (``step_model.DecoderShape.from_hf``) reads ``intermediate_size``;
# configs that name their MLP width otherwise state it under that name too (transformers keeps it)
_STATED_WIDTH = {"intermediate_size": PLAIN_MLP}


@dataclass(frozen=True)
class ZooArch:
    """One architecture's checkpoint: its transformers config class and fields (its own names)."""

    config_class: str
    config: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        """What names a cached build: the class, its fields and the tokenizer vocabulary."""
        text = json.dumps([self.config_class, self.config, VOCAB], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# HF architecture name -> its checkpoint in the shape family (every text entry of ARCHITECTURES)
ZOO: dict[str, ZooArch] = {
    "LlamaForCausalLM": ZooArch("LlamaConfig", _LLAMA_NAMES),
    "MistralForCausalLM": ZooArch("MistralConfig", _LLAMA_NAMES),
    "MixtralForCausalLM": ZooArch("MixtralConfig", {**_LLAMA_NAMES, "intermediate_size": GATED_MLP // 2,
                                                    "num_local_experts": 4, "num_experts_per_tok": 2}),
    "Qwen2ForCausalLM": ZooArch("Qwen2Config", _LLAMA_NAMES),
    "Qwen2MoeForCausalLM": ZooArch("Qwen2MoeConfig", {**_LLAMA_NAMES, "moe_intermediate_size": GATED_MLP // 4,
                                                      "shared_expert_intermediate_size": GATED_MLP // 2,
                                                      "num_experts": 4, "num_experts_per_tok": 2}),
    "Qwen3MoeForCausalLM": ZooArch("Qwen3MoeConfig", {**_LLAMA_NAMES, "moe_intermediate_size": GATED_MLP // 2,
                                                      "num_experts": 4, "num_experts_per_tok": 2,
                                                      "norm_topk_prob": True}),
    # windows as long as the positions (every window here is longer than the contexts)
    "GptOssForCausalLM": ZooArch("GptOssConfig", {**_LLAMA_NAMES, "intermediate_size": GATED_MLP // 2,
                                                  "num_local_experts": 4, "num_experts_per_tok": 2,
                                                  "sliding_window": POSITIONS}),
    # MLA (no q LoRA in V2, a q LoRA in V3), the first layer dense, one shared expert
    "DeepseekV2ForCausalLM": ZooArch("DeepseekV2Config", {**_LLAMA_NAMES, "moe_intermediate_size": GATED_MLP // 2,
                                                          "n_routed_experts": 4, "num_experts_per_tok": 2,
                                                          "n_shared_experts": 1, "first_k_dense_replace": 1,
                                                          "kv_lora_rank": 64, "q_lora_rank": None,
                                                          "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
                                                          "v_head_dim": 64, "topk_method": "greedy",
                                                          "n_group": 1, "topk_group": 1}),
    "DeepseekV3ForCausalLM": ZooArch("DeepseekV3Config", {**_LLAMA_NAMES, "moe_intermediate_size": GATED_MLP // 2,
                                                          "n_routed_experts": 4, "num_experts_per_tok": 2,
                                                          "n_shared_experts": 1, "first_k_dense_replace": 1,
                                                          "kv_lora_rank": 64, "q_lora_rank": 128,
                                                          "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
                                                          "v_head_dim": 64, "n_group": 1, "topk_group": 1}),
    "OPTForCausalLM": ZooArch("OPTConfig", {"hidden_size": HIDDEN, "ffn_dim": PLAIN_MLP, "num_hidden_layers": LAYERS,
                                            "num_attention_heads": HEADS, "word_embed_proj_dim": HIDDEN,
                                            "max_position_embeddings": POSITIONS, **_STATED_WIDTH}),
    "Qwen3ForCausalLM": ZooArch("Qwen3Config", _LLAMA_NAMES),
    "SmolLM3ForCausalLM": ZooArch("SmolLM3Config", _LLAMA_NAMES),
    "Olmo2ForCausalLM": ZooArch("Olmo2Config", _LLAMA_NAMES),
    "GraniteForCausalLM": ZooArch("GraniteConfig", _LLAMA_NAMES),
    "Phi3ForCausalLM": ZooArch("Phi3Config", _LLAMA_NAMES),
    "Glm4ForCausalLM": ZooArch("Glm4Config", _LLAMA_NAMES),
    "CohereForCausalLM": ZooArch("CohereConfig", _LLAMA_NAMES),
    "GemmaForCausalLM": ZooArch("GemmaConfig", _LLAMA_NAMES),
    "Gemma2ForCausalLM": ZooArch("Gemma2Config", _LLAMA_NAMES),
    "Gemma3ForCausalLM": ZooArch("Gemma3TextConfig", _LLAMA_NAMES),
    "StableLmForCausalLM": ZooArch("StableLmConfig", _LLAMA_NAMES),
    "Starcoder2ForCausalLM": ZooArch("Starcoder2Config", _PLAIN_NAMES),
    "GPT2LMHeadModel": ZooArch("GPT2Config", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_inner": PLAIN_MLP,
                                              "n_positions": POSITIONS, **_STATED_WIDTH}),
    "GPTJForCausalLM": ZooArch("GPTJConfig", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_inner": PLAIN_MLP,
                                              "rotary_dim": HEAD_DIM, "n_positions": POSITIONS, **_STATED_WIDTH}),
    "GPTNeoXForCausalLM": ZooArch("GPTNeoXConfig", {k: v for k, v in _PLAIN_NAMES.items()
                                                    if k not in ("num_key_value_heads", "head_dim")}),
    "PhiForCausalLM": ZooArch("PhiConfig", {k: v for k, v in _PLAIN_NAMES.items() if k != "head_dim"}),
    # MHA (Falcon's default is multi-query), parallel attention on one norm (its default)
    "FalconForCausalLM": ZooArch("FalconConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                                                  "num_attention_heads": HEADS, "multi_query": False,
                                                  "ffn_hidden_size": PLAIN_MLP, "max_position_embeddings": POSITIONS,
                                                  **_STATED_WIDTH}),
    # its MLP is 4 x hidden by construction
    "BloomForCausalLM": ZooArch("BloomConfig", {"hidden_size": HIDDEN, "n_layer": LAYERS, "n_head": HEADS,
                                                **_STATED_WIDTH}),
}


def architectures() -> list[str]:
    """The registry's text architectures, Llama (the baseline) first."""
    from gridserve.shared.model_registry import ARCHITECTURES

    names = [name for name, info in ARCHITECTURES.items() if not info.multimodal]
    return sorted(names, key=lambda name: name != BASELINE)


# ---- checkpoints -------------------------------------------------------------------------------------
def ensure_zoo_checkpoint(architecture: str, cache_dir: Optional[Path] = None) -> Path:
    """The cached tiny checkpoint of ``architecture`` (built on first use)."""
    from gridserve.demo import recipe

    arch = ZOO[architecture]
    cache = Path(cache_dir) if cache_dir is not None else recipe.default_cache_dir()
    tokenizer = recipe.ensure_tokenizer(VOCAB, cache)
    return recipe._ensure(cache / CACHE_FOLDER / f"{architecture}-{arch.key()}",
                          lambda tmp: _build(tmp, architecture, arch, tokenizer),
                          {"zoo_bench": architecture, "config_class": arch.config_class})


def _build(out: Path, architecture: str, arch: ZooArch, tokenizer: Path) -> None:
    import torch
    import transformers

    from gridserve.demo import recipe

    special = {"bos_token_id": recipe.BOS_ID, "eos_token_id": recipe.EOS_ID, "pad_token_id": recipe.PAD_ID}
    config = getattr(transformers, arch.config_class)(**special, vocab_size=VOCAB, **arch.config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    built = type(model).__name__
    if built != architecture:
        raise RuntimeError(f"{arch.config_class} builds {built}, not {architecture}")
    model.save_pretrained(out, safe_serialization=True)
    for path in tokenizer.iterdir():
        if path.is_file() and path.name != recipe.MARKER:
            shutil.copy(path, out / path.name)


# ---- FLOPs -------------------------------------------------------------------------------------------
def matmul_weights(model: Any) -> int:
    """Weights one token multiplies in a forward: every 2-D parameter but the embedding tables it
    looks up (tokens, learned positions), plus the LM head (tied or not); a MoE's expert weights
    (parameters under an ``experts`` module) scaled by ``num_experts_per_tok / num_local_experts``
    (``num_experts``: Qwen2-MoE; ``n_routed_experts``: DeepSeek)."""
    import torch

    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    config = model.config.get_text_config()
    experts = (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
               or getattr(config, "n_routed_experts", None))
    active = getattr(config, "num_experts_per_tok", 1) / experts if experts else 1.0
    seen: set[int] = set()
    total = 0.0
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.dim() < 2 or id(param) in looked_up or id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel() * (active if "experts" in name.split(".") else 1.0)
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) not in seen:
        total += head.weight.numel()
    return int(total)


def model_on_meta(config: Any) -> Any:
    """transformers' model of ``config`` (a config object or a checkpoint folder) on the meta
    device: its shapes, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, (str, Path)):
        config = AutoConfig.from_pretrained(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def step_flops(weights: int, contexts_total: float, batch: int, heads: int = HEADS, head_dim: int = HEAD_DIM,
               layers: int = LAYERS) -> dict[str, float]:
    """FLOPs of one decode step: ``matmul`` (2 x weights x batch), ``attention`` (4 x the contexts'
    tokens x heads x head_dim x layers) and ``total``."""
    matmul = 2.0 * weights * batch
    attention = 4.0 * contexts_total * heads * head_dim * layers
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


# ---- the run -----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--architectures", default=None,
                        help="comma-separated HF architecture names (default: every text architecture); "
                             f"{BASELINE} is always measured as the baseline")
    parser.add_argument("--batch-size", type=int, default=64, help="running requests (B)")
    parser.add_argument("--input-len-min", type=int, default=64)
    parser.add_argument("--input-len-max", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="decode steps measured per architecture")
    parser.add_argument("--rounds", type=int, default=3,
                        help="passes over the architectures (A B A C A ..., every other one reversed); "
                             "each figure is the median over the rounds")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads of the in-process worker (GRIDSERVE_CPU_THREADS): one by default, "
                             "as these tiny GEMMs gain little from two and a shared machine's load then "
                             "stalls a step less")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after measuring each architecture, torch.profiler's top N ops of 3 more steps")
    parser.add_argument("--output-json", default=None, help="e.g. benchmarks/results/zoo_step.json")


def _step_args(args: argparse.Namespace, model: str) -> argparse.Namespace:
    """``bench step``'s arguments (its defaults) for one architecture's checkpoint."""
    from gridserve.benchmarks.engine import add_step_arguments

    parser = argparse.ArgumentParser()
    add_step_arguments(parser)
    return parser.parse_args([
        "--model", model, "--batch-size", str(args.batch_size), "--input-len-min", str(args.input_len_min),
        "--input-len-max", str(args.input_len_max), "--steps", str(args.steps), "--seed", str(args.seed),
        "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes), "--profile", str(args.profile)])


def measure(architecture: str, args: argparse.Namespace) -> dict[str, Any]:
    """One architecture's decode step through ``bench step``'s loop, with its FLOPs."""
    from gridserve.benchmarks.engine import step_overhead

    path = str(ensure_zoo_checkpoint(architecture))
    result = step_overhead(_step_args(args, path))
    weights = matmul_weights(model_on_meta(path))
    flops = step_flops(weights, result["mean_context"] * result["running_during_measure"], args.batch_size)
    row = {"architecture": architecture, "model": path, "matmul_weights": weights,
           "running": result["running_during_measure"], "mean_context": result["mean_context"],
           "step_ms": result["median_step_ms"], "forward_ms": result["median_forward_ms"],
           "attention_ms": result["components"]["attention"]["achieved_ms"],
           "lm_head_ms": result["components"]["lm_head"]["achieved_ms"],
           "gflop": flops["total"] / 1e9, "attention_gflop": flops["attention"] / 1e9}
    if "profile_top_ops" in result:
        row["profile_top_ops"] = result["profile_top_ops"]
    return row


def per_flop_ratio(row: dict[str, Any], before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    """``row``'s ms per GFLOP (``key``: ``step_ms`` / ``forward_ms``) over the baseline's, the
    baseline's time the mean of its measurements just before and just after ``row``'s."""
    base_ms = (before[key] + after[key]) / 2
    return (row[key] / row["gflop"]) / (base_ms / before["gflop"])


def flanked_round(names: list[str], args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One round: the baseline, then each other architecture followed by the baseline again
    (A B A C A ...), so that each is compared with the baseline measured around it. Returns the
    baseline's rows and the others' rows, each with its two ratios."""
    baseline = [measure(BASELINE, args)]
    rows = []
    for name in names:
        row = measure(name, args)
        baseline.append(measure(BASELINE, args))
        for key in ("step_ms", "forward_ms"):
            row[f"{key}_per_flop_vs_llama"] = per_flop_ratio(row, baseline[-2], baseline[-1], key)
        logger.info("%s: %.2f ms a step, %.2f x Llama's time per FLOP", name, row["step_ms"],
                    row["step_ms_per_flop_vs_llama"])
        rows.append(row)
    return baseline, rows


def combine(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One architecture's row over its rounds: the median of each time and of each ratio (the
    baseline's ratios are 1 by definition), and each round's step ratio."""
    row = dict(samples[-1])
    for key in ("step_ms", "forward_ms", "attention_ms", "lm_head_ms", "step_ms_per_flop_vs_llama",
                "forward_ms_per_flop_vs_llama"):
        row[key] = statistics.median(s.get(key, 1.0) for s in samples)
    row["step_ms_per_gflop"] = row["step_ms"] / row["gflop"]
    if row["architecture"] != BASELINE:
        row["step_ms_per_flop_vs_llama_per_round"] = [s["step_ms_per_flop_vs_llama"] for s in samples]
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    """Per architecture: weights, GFLOP, step / forward / attention / LM head ms, the two ratios."""
    lines = [f"{'architecture':<24}{'weights M':>10}{'GFLOP':>7}{'step ms':>9}{'fwd ms':>8}{'attn ms':>9}"
             f"{'head ms':>9}{'step/FLOP':>11}{'fwd/FLOP':>10}"]
    for r in rows:
        lines.append(f"{r['architecture']:<24}{r['matmul_weights'] / 1e6:>10.2f}{r['gflop']:>7.3f}"
                     f"{r['step_ms']:>9.2f}{r['forward_ms']:>8.2f}{r['attention_ms']:>9.2f}{r['lm_head_ms']:>9.2f}"
                     f"{r['step_ms_per_flop_vs_llama']:>11.2f}{r['forward_ms_per_flop_vs_llama']:>10.2f}")
    return "\n".join(lines)


def _selected(args: argparse.Namespace) -> list[str]:
    every = architectures()
    if not args.architectures:
        return every
    chosen = [name.strip() for name in args.architectures.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        raise SystemExit(f"--architectures: not a text architecture of the registry: {', '.join(unknown)}")
    return [BASELINE] + [name for name in chosen if name != BASELINE]


def run(args: argparse.Namespace) -> int:
    names = _selected(args)
    os.environ["GRIDSERVE_CPU_THREADS"] = str(args.cpu_threads)  # read by Worker.init_device
    load_before = os.getloadavg()
    start = time.time()
    others = [name for name in names if name != BASELINE]
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        baseline, rows = flanked_round(others if round_ % 2 == 0 else others[::-1], args)
        samples[BASELINE] += baseline
        for row in rows:
            samples[row["architecture"]].append(row)
    rows = [combine(samples[name]) for name in names]
    print(format_table(rows))
    results = {
        "shape": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "head_dim": HEAD_DIM, "vocab": VOCAB,
                  "gated_intermediate": GATED_MLP, "plain_intermediate": PLAIN_MLP},
        "batch_size": args.batch_size, "input_len": [args.input_len_min, args.input_len_max], "steps": args.steps,
        "rounds": args.rounds, "cpu_threads": args.cpu_threads, "cpu_count": os.cpu_count(),
        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
        "wall_s": time.time() - start, "rows": rows,
    }
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")
    return 0
