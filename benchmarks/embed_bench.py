"""``gridserve bench embed``: embedding throughput, gridserve ``LLM.embed`` vs sentence-transformers' ``encode``.

    gridserve bench embed                                  # 256 inputs per workload, 3 runs
    gridserve bench embed --num-inputs 64 --runs 1 --output-json embed.json

Issue 37's speed criterion: on a BERT-base shape (``transformers.BertConfig`` defaults: hidden 768,
12 layers, 12 heads, intermediate 3072, vocab 30522, 512 positions; random weights, fp32) built
once under ``--cache-dir``, with sentence-transformers' files (mean pooling, normalised), gridserve
must embed >= 1.0x as fast as sentence-transformers at a uniform 128 tokens and >= 1.5x at mixed
lengths uniformly 16..512 (sentence-transformers pads each batch of 32 to its longest input;
gridserve packs whole inputs, no padding, up to ``max_num_batched_tokens`` per step).

Both sides get the **same texts**, built to tokenize to the wanted lengths: the checkpoint's
tokenizer is a word-level one (``w<id>`` -> id, ``[CLS] $A [SEP]``), so a text of n-2 words is
n tokens and tokenizing is cheap on both sides (it is inside both timings). Same thread count
for both: ``torch.set_num_threads`` to what gridserve's worker uses (``GRIDSERVE_CPU_THREADS`` or
``os.cpu_count()``). Runs alternate sentence-transformers, gridserve, sentence-transformers, ...;
each run checks every gridserve embedding against sentence-transformers' (cosine > 0.9999).
Reported: inputs/s and tokens/s per side (median over runs) and the ratio per workload.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

FIRST_WORD_ID = 1000  # word ids are drawn from [FIRST_WORD_ID, vocab); 0..999 hold the specials
SPECIALS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
MIN_LEN, MAX_LEN, UNIFORM_LEN = 16, 512, 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-inputs", type=int, default=256, help="inputs per workload")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per side")
    parser.add_argument("--st-batch-sizes", default="32",
                        help="comma-separated sentence-transformers batch sizes (the best is the baseline)")
    parser.add_argument("--max-num-batched-tokens", default="default",
                        help="comma-separated gridserve token budgets per step; 'default' is the engine's")
    parser.add_argument("--workloads", default="uniform,mixed", help="uniform (128 tokens) and/or mixed (16..512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "gridserve-embed-bench"),
                        help="where the BERT-base checkpoint is built (kept between runs)")
    parser.add_argument("--output-json", default=None)


def lengths(workload: str, n: int, seed: int = 0) -> list[int]:
    """Token counts (specials included) per input: 128 each, or uniform in [16, 512]."""
    if workload == "uniform":
        return [UNIFORM_LEN] * n
    if workload == "mixed":
        rng = random.Random(seed)
        return [rng.randint(MIN_LEN, MAX_LEN) for _ in range(n)]
    raise ValueError(f"unknown workload {workload!r} (uniform or mixed)")


def texts_for(token_counts: list[int], vocab: int = 30522, seed: int = 0) -> list[str]:
    """One text per count whose tokenization (``[CLS]`` + words + ``[SEP]``) is exactly that many tokens."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(FIRST_WORD_ID, vocab)}" for _ in range(n - 2)) for n in token_counts]


def budgets(value: str) -> list[int | None]:
    return [None if v.strip() == "default" else int(v) for v in value.split(",") if v.strip()]


def summarize(seconds: list[float], num_inputs: int, num_tokens: int) -> dict:
    """Median over runs of one side's wall times -> inputs/s and tokens/s."""
    median = statistics.median(seconds)
    return {"seconds": [round(s, 3) for s in seconds], "median_s": round(median, 3),
            "inputs_per_s": round(num_inputs / median, 2), "tokens_per_s": round(num_tokens / median, 1)}


def ratio(ours: dict, baseline: dict) -> float:
    return round(baseline["median_s"] / ours["median_s"], 2)


def build_checkpoint(root: Path) -> Path:
    """BERT-base (random weights), a word-level tokenizer and sentence-transformers' files, once."""
    folder = root / "bert-base-random"
    if (folder / "modules.json").exists():
        return folder
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tmp = root / f"tmp-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    config = transformers.BertConfig()  # the BERT-base defaults
    torch.manual_seed(0)
    transformers.BertModel(config, add_pooling_layer=False).eval().save_pretrained(str(tmp))
    vocab = {f"w{i}": i for i in range(FIRST_WORD_ID, config.vocab_size)}
    vocab.update(SPECIALS)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", SPECIALS["[CLS]"]), ("[SEP]", SPECIALS["[SEP]"])])
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=config.max_position_embeddings,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"]).save_pretrained(str(tmp))
    st = "sentence_transformers.models."
    (tmp / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": f"{st}Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": f"{st}Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": f"{st}Normalize"}]))
    (tmp / "1_Pooling").mkdir(exist_ok=True)
    (tmp / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": config.hidden_size, "pooling_mode_mean_tokens": True}))
    (tmp / "2_Normalize").mkdir(exist_ok=True)
    (tmp / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": config.max_position_embeddings, "do_lower_case": False}))
    tmp.rename(folder)
    return folder


def run(args: argparse.Namespace) -> int:
    import torch
    from sentence_transformers import SentenceTransformer

    from gridserve import LLM
    from gridserve.shared import envs

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    threads = envs.GRIDSERVE_CPU_THREADS or (os.cpu_count() or 1)  # what gridserve's CPU worker sets
    torch.set_num_threads(threads)
    folder = build_checkpoint(Path(args.cache_dir))
    st_model = SentenceTransformer(str(folder), device="cpu")
    st_batches = [int(b) for b in args.st_batch_sizes.split(",")]
    engines = {}
    for budget in budgets(args.max_num_batched_tokens):
        name = f"gridserve (max_num_batched_tokens={budget or 'default'})"
        engines[name] = LLM(model=str(folder), dtype="float32",
                            **({"max_num_batched_tokens": budget} if budget else {}))
    torch.set_num_threads(threads)  # the same for both, whatever the engine set
    vocab = st_model[0].auto_model.config.vocab_size
    result = {"benchmark": "embed", "model": "BERT-base shape (random weights, fp32)", "threads": threads,
              "cpus": os.cpu_count(), "num_inputs": args.num_inputs, "runs": args.runs, "workloads": {}}
    load = [os.getloadavg()[0]]
    for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        counts = lengths(workload, args.num_inputs, args.seed)
        texts = texts_for(counts, vocab, args.seed)
        n_tokens = sum(counts)
        sides = [(f"sentence-transformers (batch_size={b})", b) for b in st_batches] + [(k, None) for k in engines]
        seconds: dict[str, list[float]] = {name: [] for name, _ in sides}
        # warm-up: one small call per side
        for name, b in sides:
            if b is None:
                engines[name].embed(texts[:4], use_tqdm=False)
            else:
                st_model.encode(texts[:4], batch_size=b)
        for r in range(args.runs):
            reference = None
            for name, b in sides:  # alternating: each ST setting, then each gridserve one
                start = time.perf_counter()
                if b is None:
                    vectors = torch.tensor([o.outputs.embedding for o in engines[name].embed(texts, use_tqdm=False)])
                else:
                    vectors = st_model.encode(texts, batch_size=b, convert_to_tensor=True)
                seconds[name].append(time.perf_counter() - start)
                if reference is None:
                    reference = vectors.float()
                else:
                    cos = torch.nn.functional.cosine_similarity(vectors.float(), reference, dim=-1)
                    if float(cos.min()) <= 0.9999:
                        raise RuntimeError(f"{name}: embeddings disagree with sentence-transformers "
                                           f"(min cosine {float(cos.min()):.6f})")
            load.append(os.getloadavg()[0])
            logger.info("%s run %d: %s", workload, r + 1,
                        ", ".join(f"{k} {v[-1]:.2f}s" for k, v in seconds.items()))
        summary = {name: summarize(s, args.num_inputs, n_tokens) for name, s in seconds.items()}
        st_best = min((s for n, s in summary.items() if n.startswith("sentence")), key=lambda s: s["median_s"])
        result["workloads"][workload] = {
            "tokens": n_tokens, "mean_len": round(n_tokens / args.num_inputs, 1), "sides": summary,
            "ratio_vs_st_best": {n: ratio(s, st_best) for n, s in summary.items() if n in engines},
            "ratio_vs_st_32": ({n: ratio(s, summary["sentence-transformers (batch_size=32)"])
                                for n, s in summary.items() if n in engines}
                               if "sentence-transformers (batch_size=32)" in summary else None)}
    result["load_average"] = {"min": min(load), "max": max(load)}
    print(json.dumps(result, indent=2))
    print("\n| workload | side | median s | inputs/s | tokens/s | vs ST best |\n|---|---|---|---|---|---|")
    for workload, w in result["workloads"].items():
        for name, s in w["sides"].items():
            r = w["ratio_vs_st_best"].get(name)
            print(f"| {workload} | {name} | {s['median_s']} | {s['inputs_per_s']} | {s['tokens_per_s']} | "
                  f"{f'{r}x' if r else '-'} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    for llm in engines.values():
        llm.shutdown()
    return 0
