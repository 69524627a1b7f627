"""Throughput, latency and memory of ``trl-dance serve-reward`` on loopback.

    python benchmarks/reward_server.py                          # brightness, 400 requests of 8 PNG 64² images, 16 clients
    python benchmarks/reward_server.py --reward aesthetic --size 512 --requests 100

Starts the real server process (default limits), sends ``--requests`` requests of ``--images`` images from
``--clients`` concurrent connections, checks every answer, and prints requests/s, images/s, p50/p99 latency and the
server's peak resident memory (sampled every 20 ms), with its idle memory for comparison. The last line is JSON.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def _png(image: torch.Tensor) -> str:
    buffer = io.BytesIO()
    Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reward", default="brightness")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "trl_dance.cli", "serve-reward", args.reward, "--port", str(port)]
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {server.communicate()[1][-2000:]}") from None
            time.sleep(0.2)
    images = torch.rand(args.images, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    payload = {"prompts": ["a photo"] * args.images, "images": [_png(i) for i in images], "image_format": "png"}
    idle, peak, done = _rss(server.pid), 0, threading.Event()

    def sample_memory():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss(server.pid))
            time.sleep(0.02)

    latencies = []
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=args.clients)) as client:

        def one(_):
            start = time.perf_counter()
            response = client.post(f"{url}/score", json=payload)
            latencies.append(time.perf_counter() - start)
            assert response.status_code == 200 and len(response.json()["rewards"]) == args.images, response.text
            return response.json()["rewards"]

        threading.Thread(target=sample_memory, daemon=True).start()
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            answers = list(pool.map(one, range(args.requests)))
        elapsed = time.perf_counter() - start
        done.set()
    assert all(a == answers[0] for a in answers)
    server.terminate()
    server.wait(timeout=30)
    latencies.sort()
    result = {
        "reward": args.reward,
        "requests": args.requests,
        "images_per_request": args.images,
        "size": args.size,
        "clients": args.clients,
        "requests_per_s": args.requests / elapsed,
        "images_per_s": args.requests * args.images / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "idle_rss_mb": idle / 2**20,
        "peak_rss_mb": peak / 2**20,
    }
    print(
        f"{args.requests} requests × {args.images} images of {args.size}² from {args.clients} clients: "
        f"{result['requests_per_s']:.0f} requests/s ({result['images_per_s']:.0f} images/s), p50 "
        f"{result['p50_ms']:.0f} ms, p99 {result['p99_ms']:.0f} ms; server memory {result['idle_rss_mb']:.0f} MB idle, "
        f"{result['peak_rss_mb']:.0f} MB peak"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
