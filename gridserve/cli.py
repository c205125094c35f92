"""The ``gridserve`` command line: ``serve`` (offline demo until the services land) and ``bench``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gridserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the demo model (offline LLM demo for now)")
    serve.add_argument("model", nargs="?", default=None, help="HF folder or hub id (default: built demo model)")
    serve.add_argument("--port", type=int, default=8000, help="API port (used once the services land)")
    serve.add_argument("--max-tokens", type=int, default=32)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_sub.add_parser("throughput", help="offline throughput vs transformers generate")
    from gridserve.bench.throughput import add_arguments

    add_arguments(throughput)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve_demo(args)
    from gridserve.bench.throughput import run

    return run(args)


def _serve_demo(args: argparse.Namespace) -> int:
    from gridserve import LLM, SamplingParams
    from gridserve.recipe import ensure_checkpoint

    model = args.model or str(ensure_checkpoint("llama", "small"))
    llm = LLM(model=model)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.max_tokens)
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class HTTPServer("]
    print(f"gridserve demo: offline LLM on {model}\n(the gRPC services and the OpenAI API on "
          f"port {args.port} arrive with the services issue)\n")
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"--- prompt: {out.prompt!r}\n{out.prompt}{out.outputs[0].text}\n")
    chat = llm.chat([{"role": "user", "content": "Write a loop."}], params, use_tqdm=False)[0]
    print(f"--- chat reply: {chat.outputs[0].text!r}")
    if sys.stdin.isatty():
        print("\nType a prompt (empty line to quit):")
        for line in sys.stdin:
            if not line.strip():
                break
            print(llm.generate([line.rstrip("\n")], params, use_tqdm=False)[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
