"""Benchmarks, one package: every benchmark is a ``gridserve bench NAME`` command (``BENCHMARKS``
below; what each measures, how, and its current figures: docs/benchmarks/README.md). Their current
results live in ``benchmarks/results/``; the ``*.sh`` scripts are the GPU / device-machine checks.

Import-light: this module imports nothing, and every command's module imports torch (or any other
heavy dependency) only inside its run function, since ``gridserve`` builds every bench parser at
start. The runtime images do not ship this package (``gridserve bench`` then says so).
"""

# `gridserve bench NAME`: (module in gridserve.benchmarks, help, its add-arguments fn, its run fn).
BENCHMARKS = {
    "throughput": ("throughput", "offline throughput vs transformers generate", "add_arguments", "run"),
    "executor": ("executor", "GrpcExecutor vs UniProcExecutor throughput and round trips",
                 "add_arguments", "run"),
    "sampler": ("sampler", "sampler cost per step: plain vs mixed batch", "add_arguments", "run"),
    "quantization": ("quantization", "accuracy (KL, greedy agreement) and memory per weight / KV mode vs fp32",
                     "add_arguments", "run"),
    "quantization-speed": ("quantization", "offline throughput per weight / KV mode vs fp32",
                           "add_speed_arguments", "run_speed"),
    "quantization-step": ("quantization", "decode step per weight / KV mode vs its memory-bandwidth floor",
                          "add_step_arguments", "run_step"),
    "serve": ("serve", "online load against an OpenAI-compatible server", "add_arguments", "run"),
    "peer": ("peer", "workload W on gridserve (Envoy) vs vLLM's CPU build and llama.cpp's llama-server per precision pair",
             "add_arguments", "run"),
    "step": ("engine", "decode-step wall time vs the model forward inside it", "add_step_arguments",
             "run_step"),
    "zoo-step": ("zoo_step", "decode step per built-in architecture, per FLOP, vs Llama's (tiny shapes)",
                 "add_arguments", "run"),
    "prefix": ("engine", "TTFT with a cached long prefix vs a cold one", "add_prefix_arguments",
               "run_prefix"),
    "disaggregated": ("disagg_bench", "long prompts + long outputs: serve --disaggregated 1:1 vs -dp 2, workers "
                      "pinned one per core (TTFT p99, ITL p99, throughput)", "add_arguments", "run"),
    "prefix-routing": ("prefix_routing", "DP=4 shared system prompts: --routing-policy prefix vs load (hit rate, "
                       "throughput, TTFT)", "add_arguments", "run"),
    "observability": ("observability", "engine step time with metrics / tracing off and on",
                      "add_arguments", "run"),
    "edge": ("edge", "TTFT through the Envoy edge vs straight to the gateway", "add_arguments", "run"),
    "slowloris": ("slowloris", "a probe's p99 latency at the edge idle vs while slow clients trickle headers",
                  "add_arguments", "run"),
    "plot": ("plot", "throughput and latency vs concurrency from bench serve JSON", "add_arguments", "run"),
    "fuzz": ("fuzz", "hostile generated requests through the edge: never a 5xx, a hang or a leak",
             "add_arguments", "run"),
    "chaos": ("chaos", "DP=2 streaming load while engines / coordinator / workers are SIGKILLed",
              "add_arguments", "run"),
    "kernels": ("kernels_bench", "Triton kernels vs the torch reference and the bandwidth roofline (CUDA; "
                "--interpret on CPU)", "add_arguments", "run"),
    "gpu-attention": ("gpu_attention_bandwidth", "CUDA paged-attention decode bandwidth vs a copy and the HBM peak",
                      "add_arguments", "run"),
    "cpu-attention": ("cpu_attention_bench", "C++ CPU paged attention vs the torch reference (or its portable loops)",
                      "add_arguments", "run"),
    "layer-ops": ("layer_ops_bench", "C++ CPU layer ops (norms, RoPE, SiLU, KV write) vs the torch reference",
                  "add_arguments", "run"),
    "bf16": ("bf16_bench", "bf16 weights on the CPU vs fp32: packed / plain GEMMs per SmolLM2 shape, offline "
             "prefill and decode throughput", "add_arguments", "run"),
    "roofline": ("roofline", "W's GEMM FLOPs over this machine's best GEMM rate per precision: the fastest W "
                 "could run, against measured servers", "add_arguments", "run"),
    "int8-gemm": ("int8_gemm_bench", "int8-weight CPU GEMM (int16 / group-32 / oneDNN) vs fp32 F.linear",
                  "add_arguments", "run"),
    "spec-decode": ("spec_decode_bench", "speculative decoding (n-gram or a draft model) vs plain, one request at a "
                    "time and a batch; with a draft model the step-time model",
                    "add_arguments", "run"),
    "lora": ("lora_bench", "served W with every request on one of 4 LoRA adapters vs on the base model",
             "add_arguments", "run"),
    "embed": ("embed_bench", "embedding throughput: LLM.embed vs sentence-transformers encode (BERT-base, "
              "uniform 128 / mixed 16-512 tokens)", "add_arguments", "run"),
    "fused-moe": ("fused_moe_bench", "the fused MoE layer vs the per-expert loop it replaced (batch 1 / 16 / 64)",
                  "add_arguments", "run"),
    "expert-parallel": ("ep_bench", "served decode of a Qwen3-MoE shape, DP=2 with expert parallelism vs without",
                        "add_arguments", "run"),
    "mla": ("mla_bench", "MLA decode: latents expanded vs weights absorbed (torch, C++), context 256 / 1k / 4k",
            "add_arguments", "run"),
    "batch-invariant": ("batch_invariant_bench", "decode step and prefill with batch-invariant mode vs without",
                        "add_arguments", "run"),
    "parallel": ("parallel_bench", "decode step per TPxPP layout and the gloo collectives inside a TP step",
                 "add_arguments", "run"),
    "vision": ("vision_bench", "image preprocessing, media loader pool, image-request TTFT cold vs warm",
               "add_arguments", "run"),
    "default-model": ("default_model_bench", "the default model: gridserve serve to ready (cold, warm) and "
                      "served W per precision", "add_arguments", "run"),
    "served-ab": ("served_ab", "served W from two source trees (each with its own .venv), alternating B A B A",
                  "add_arguments", "run"),
    "agent-parsing": ("agent_parsing", "tool / reasoning parsers and forced-call grammar, ms per token", "add_arguments", "run"),
    "cpu-by-process": ("cpu_by_process", "CPU seconds of every process on the machine while a command runs",
                       "add_arguments", "run"),
}

# Modules that are not a command's own but libraries the commands import (a test keeps the
# package to commands + these).
LIBRARIES = ("datasets", "metrics", "probe", "llama_server", "vllm_server", "peer_server", "peer_report",
             "step_model", "harness")
