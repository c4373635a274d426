"""The README's screenshot of the web page (docs/images/web-page.png), under a minute of changing load.

    python scripts/web_page_screenshot.py [--out docs/images/web-page.png] [--seconds 45]

Starts `python -m nanoserve.server.app` on the bundled model (a pool of 1024 blocks: one grid cell per block),
opens the page in headless Chromium (Debian's, through Playwright, as tests/server/test_web_page.py does), asks
the calculator two questions in the chat, and meanwhile sends waves of requests that share a system prompt (so
the prefix cache has something to find), of varied lengths; the screenshot is taken in the last wave.
"""

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You are a careful assistant who answers questions about arithmetic and tells short stories. " * 2


def start_server(port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.server.app", "--port", str(port), "--num-kv-blocks",
                             "1024", "--disable-log-requests", "--uvicorn-log-level", "warning"], cwd=REPO, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not start")


def load(url: str, last: threading.Event) -> None:
    """Waves of 4 to 16 concurrent chat requests, then, once `last` is set, one of 24."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(0)

    def one(i: int) -> None:
        client.chat.completions.create(
            model="nanoserve-tiny", max_tokens=rng.randrange(60, 300), temperature=0.8,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me story {i}."}],
            extra_body={"ignore_eos": True})

    wave = 0
    while True:
        final = last.is_set()
        size = 24 if final else rng.choice([4, 8, 16])
        threads = [threading.Thread(target=one, args=(wave * 100 + i,)) for i in range(size)]
        for t in threads:
            t.start()
            time.sleep(rng.random() * 0.15)
        for t in threads:
            t.join()
        if final:
            return
        time.sleep(rng.random() * 2)
        wave += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "docs/images/web-page.png"))
    p.add_argument("--seconds", type=float, default=45)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = start_server(port)
    last = threading.Event()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(url)
            page.wait_for_selector("#live.on")
            loader = threading.Thread(target=load, args=(url, last))
            started = time.monotonic()
            loader.start()
            for question in ("What is 12*34?", "What is 1234+5678?"):
                page.fill("#input", question)
                page.press("#input", "Enter")
                page.locator(".msg.assistant .meta", has_text="finish").nth(-1).wait_for(timeout=60_000)
                time.sleep(2)
            # The last wave: wait for it to be under way, then take the picture.
            time.sleep(max(0.0, args.seconds - (time.monotonic() - started)))
            last.set()
            page.wait_for_function("Number(document.getElementById('stat-running').textContent) >= 8",
                                   timeout=60_000)
            time.sleep(1.0)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out)
            print(f"wrote {args.out}")
            loader.join()
            browser.close()
    finally:
        last.set()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
