"""The worker role: owns a device, the model weights and the KV-cache tensors; runs forward + sampler."""

import os

# Large CPU tensors (the weights, the KV cache) on 2 MiB transparent huge pages: PyTorch's CPU
# allocator madvises allocations of 2 MiB and more when THP_MEM_ALLOC_ENABLE is set before its
# first allocation (this package is imported before torch allocates in every worker process and
# in LLM). A decode step reads GBs of KV blocks scattered over the cache: on 4 KiB pages the TLB
# misses halved the read bandwidth here (benchmarks/cpu_attention_bench.py, docs/benchmarks/README.md "Where a decode
# step goes"). Effective where the kernel's THP mode is "madvise" or "always"; a value the operator
# set (THP_MEM_ALLOC_ENABLE=0) wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
