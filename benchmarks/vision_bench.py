"""Image input costs, one run: the gateway's preprocessing per image, the media loader pool's
throughput with 8 threads vs 1, and TTFT of an image request with a cold vs a warm prefix cache.

    gridserve bench vision [--output-json out.json]

Preprocessing: decode a 640x480 JPEG and run the image processor (the llava-tiny recipe's and
CLIP-L/336's configuration), median of 50. Loader: 64 ``http://127.0.0.1`` fetches from a local
server that answers each after 50 ms (a stand-in for the network), 8 loader threads vs 1. TTFT:
``LLM.generate`` with one output token on the llava-tiny checkpoint, a 25-token image after a
~300-token text prompt; cold = a new image each time, warm = the same image again (prefix hit).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CLIP_336 = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
TINY = {"size": {"shortest_edge": 32}, "crop_size": {"height": 30, "width": 30}}
LATENCY_S = 0.05


def _jpeg(seed: int, height: int = 480, width: int = 640) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    smooth = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    image = Image.fromarray(smooth).resize((width, height), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def preprocessing_ms(config: dict, data: bytes, repeats: int = 50) -> float:
    from gridserve.services.gateway.image_processor import ImageProcessor
    from gridserve.services.gateway.media_loader import decode_image

    processor = ImageProcessor.from_config(config)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        processor(decode_image("image", data))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def loader_images_per_s(threads: int, url: str, count: int = 64) -> float:
    from gridserve.services.gateway.media_loader import MediaConfig, MediaLoader

    # the bench serves its images on loopback, which the fetcher refuses to anyone else
    loader = MediaLoader(MediaConfig(thread_count=threads, allowed_media_domains=("127.0.0.1",)),
                         address_allowed=lambda host, address: True)

    async def load() -> None:  # one image per request (a request may carry only a few), all at once
        await asyncio.gather(*(loader.load_all([(f"image[{i}]", url)]) for i in range(count)))

    start = time.perf_counter()
    asyncio.run(load())
    loader.close()
    return count / (time.perf_counter() - start)


def ttft_ms(repeats: int = 5) -> tuple[float, float]:
    from PIL import Image

    from gridserve import LLM, SamplingParams
    from gridserve.demo.recipe import ensure_checkpoint

    llm = LLM(model=str(ensure_checkpoint("llava", "tiny")), kv_cache_memory_bytes=32 << 20)
    text = "def walk(tree):\n    for node in tree.children:\n        yield from walk(node)\n" * 12
    prompt = f"<|im_start|>user\n<image>{text}<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def once(seed: int) -> float:
        image = Image.open(io.BytesIO(_jpeg(seed, 40, 52)))
        start = time.perf_counter()
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, use_tqdm=False)
        return time.perf_counter() - start

    once(1000)  # warm-up (kernels, allocator)
    cold = [once(seed) for seed in range(repeats)]
    warm = [once(0) for _ in range(repeats)]
    llm.shutdown()
    return 1000 * statistics.median(cold), 1000 * statistics.median(warm)


class _Slow(BaseHTTPRequestHandler):
    body = b""  # the JPEG, set by run()

    def do_GET(self):  # noqa: N802 - http.server's name
        time.sleep(LATENCY_S)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json", "--json", dest="output_json", help="write the results here too")


def run(args: argparse.Namespace) -> int:
    data = _Slow.body = _jpeg(0)
    results = {"preprocess_ms_llava_tiny": preprocessing_ms(TINY, data),
               "preprocess_ms_clip_336": preprocessing_ms(CLIP_336, data)}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/photo.jpg"
    results["loader_images_per_s_1_thread"] = loader_images_per_s(1, url)
    results["loader_images_per_s_8_threads"] = loader_images_per_s(8, url)
    httpd.shutdown()
    results["ttft_ms_cold"], results["ttft_ms_warm"] = ttft_ms()
    for name, value in results.items():
        print(f"{name:34s} {value:10.2f}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
