"""docs/webui.png: the page at / under load, on the default model (SmolLM2), in Debian's chromium.

Usage: PYTHONPATH=. python scripts/webui_screenshot.py [--out docs/webui.png] [--load 8]
Starts a server in-process, keeps `--load` long chat requests running from a background client,
sends one chat from the page and shoots once its reply has streamed a few lines.
"""

from __future__ import annotations

import argparse
import threading

import httpx
from playwright.sync_api import sync_playwright

from conveyor.config import EngineConfig, ServerConfig
from conveyor.server.background import serve_in_thread

CHROMIUM = "/usr/lib/chromium/chromium"
TOPICS = ["the sea", "a robot", "autumn", "coffee", "a lighthouse", "trains", "the moon", "bees"]


def background_chat(url: str, topic: str, stop: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
            "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for _ in r.iter_lines():
            if stop.is_set():
                return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/webui.png")
    ap.add_argument("--load", type=int, default=8)
    args = ap.parse_args()
    stop = threading.Event()
    with serve_in_thread(EngineConfig(parallel=args.load + 2), ServerConfig(metrics=True)) as (url, _core):
        threads = [threading.Thread(target=background_chat, args=(url, TOPICS[i % len(TOPICS)], stop), daemon=True)
                   for i in range(args.load)]
        for t in threads:
            t.start()
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 820})
            page.set_default_timeout(300_000)
            page.goto(url)
            page.wait_for_function(f"() => document.querySelectorAll('#slots tr[data-state=decoding]').length >= {args.load}")
            # Half a minute of history, so the charts show a line rather than a few points.
            page.wait_for_function("() => state.history.length && state.history.at(-1).t - state.history[0].t > 30")
            page.fill("#prompt", "What is continuous batching in LLM serving? Answer in a few sentences.")
            page.click("#send")
            page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 200")
            page.wait_for_function("() => document.querySelectorAll('#slots tr[data-state=decoding]').length >= "
                                   f"{args.load + 1}")
            page.screenshot(path=args.out)
            browser.close()
        stop.set()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
