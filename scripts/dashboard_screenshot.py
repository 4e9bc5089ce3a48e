"""Screenshots of the dashboard and the chat page for the README: starts a local SmolLM2 swarm (three peers on
127.0.0.1), ``python -m swarm.api`` over it, and headless Chromium, then writes docs/dashboard.png and docs/chat.png.
With ``--peers 50 --model random48``: a swarm of 50 peers of a random 48-block Llama (forked from one fork server,
placed by the broker, default timings), of which a few quit (SIGKILL, Ctrl-C) and as many join while it is watched;
writes docs/dashboard-50.png and docs/status-50.txt (``swarm.status`` once, and ``--watch`` across the churn).

    python scripts/dashboard_screenshot.py [--out docs] [--prompt "..."]
    python scripts/dashboard_screenshot.py --peers 50 --model random48

Every process it starts is stopped by its PID."""

from __future__ import annotations

import argparse
import math
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.local_swarm import ApiProcess  # noqa: E402
from swarm.launch import LocalSwarm, PeerProcess  # noqa: E402
from tests.helpers.browser import chrome, map_peers, save_screenshot, wait_until  # noqa: E402

MODEL = "smollm2-135m"
STARTUP = 300.0
BATCH = 8  # peers started at once (more at once, and p2pd daemons miss their start deadline on a loaded machine)
BIG_STARTUP = 900.0  # 50 peers forked on a loaded 2-core machine, placed by the broker one round at a time


def chat(driver: Any, url: str, prompt: str, out: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(url + "/chat")
    wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "#model option"), 30, "the model list")
    Select(driver.find_element(By.ID, "model")).select_by_visible_text(MODEL)
    driver.find_element(By.ID, "message").send_keys(prompt)
    driver.find_element(By.ID, "send").click()
    done = ".msg.assistant.done, .msg.assistant.failed"
    wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, done), 300, "the answer")
    save_screenshot(driver, out / "chat.png")


def run_status(initial_peers: list[str], model: str, *extra: str, timeout: float = 180.0) -> str:
    """``python -m swarm.status`` once (or, with ``--watch``, for its rounds): what it printed."""
    cmd = [sys.executable, "-m", "swarm.status", "--initial-peers", *initial_peers[:2], "--model", model, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:  # stopped by its PID
            proc.kill()
            proc.wait(10)


def page_state(driver: Any) -> dict[str, Any]:
    """What the dashboard shows now: its peers by state, its coverage badge and its events' kinds (one script)."""
    script = """
        const rows = [...document.querySelectorAll('table.map tbody tr[data-peer-id]')];
        return {peers: rows.map(r => r.dataset.peerId),
                badge: (document.querySelector('.coverage-badge') || {}).textContent || '',
                count: (document.querySelector('.peer-count') || {}).textContent || '',
                events: [...document.querySelectorAll('ol.events li .kind')].map(k => k.textContent)};
    """
    return dict(driver.execute_script(script))


def grow(swarm: LocalSwarm, count: int, *extra: str) -> list[PeerProcess]:
    """``count`` more peers, started a batch at a time. On a loaded machine a peer's p2pd can miss its start deadline
    (the peer then exits): it is replaced, up to ``count`` times in all."""
    up: list[PeerProcess] = []
    failed = 0
    while len(up) < count:
        batch = [swarm.add_peer(None, *extra, wait=False) for _ in range(min(BATCH, count - len(up)))]
        for peer in batch:
            try:
                peer.wait_ready(BIG_STARTUP)
                up.append(peer)
            except RuntimeError:
                failed += 1
                if failed > count:
                    raise
    return up


def big_swarm(n: int, out: Path) -> int:
    """``n`` peers of a random 48-block Llama, watched while two are killed, one quits by Ctrl-C and three join."""
    from harness.fork_server import ForkServer
    from scripts.bench_scale import BLOCKS, make_model

    work = Path(tempfile.mkdtemp(prefix="swarm-screenshot-50-"))
    folder = make_model(work / "random48")  # the model id is the folder's name
    args = ("--throughput", "100", "--max-blocks", str(math.ceil(2 * BLOCKS / n)))
    fork = ForkServer()
    swarm = LocalSwarm(
        str(folder),
        [None],
        extra_args=args,
        log_dir=work / "logs",
        startup_timeout=BIG_STARTUP,
        spawner=fork,  # type: ignore[arg-type]  # its spawn also takes a timeout (as in scripts/bench_scale.py)
    )
    driver = None
    watch: subprocess.Popen[str] | None = None
    try:
        swarm.start()
        live = [swarm.peers[0], *grow(swarm, n - 2)]
        board = grow(swarm, 1, "--dashboard-port", "0")[0]  # the n-th peer serves the dashboard
        driver = chrome(work / "profile", 1400, 1000)
        driver.get(board.urls["dashboard"])
        everyone = {p.peer_id for p in [*live, board]}

        def settled() -> bool:  # every peer on the map, the model covered, nobody still joining
            s = page_state(driver)
            return set(s["peers"]) == everyone and s["badge"] == "fully covered" and "joining" not in s["count"]

        wait_until(settled, BIG_STARTUP, "the swarm to settle on the dashboard", period=2.0)
        watch_log = work / "watch.txt"
        with open(watch_log, "w") as sink:
            cmd = ["--initial-peers", *swarm.initial_peers[:2], "--model", folder.name, "--watch", "10"]
            watch = subprocess.Popen(
                [sys.executable, "-m", "swarm.status", *cmd, "--rounds", "60"],
                stdout=sink,
                stderr=sink,
                cwd=ROOT,
                text=True,
            )
        time.sleep(15)  # its first read, before the churn
        rng = random.Random(50)
        quitting = rng.sample(live[1:], 3)  # the first peer is everyone's bootstrap: it stays
        for peer, sig in zip(quitting, (signal.SIGKILL, signal.SIGKILL, signal.SIGINT), strict=True):
            swarm.kill(peer, sig)
        grow(swarm, 3)
        gone = {p.peer_id for p in quitting}

        def churned() -> bool:  # the quits off the map, the newcomers on it, both in the events
            s = page_state(driver)
            kinds = s["events"]
            return not gone & set(s["peers"]) and kinds.count("left") >= 3 and kinds.count("joined") >= 3

        try:
            wait_until(churned, 180, "the quits and joins on the dashboard", period=2.0)
        except AssertionError as e:  # the picture shows what the swarm got to (a loaded machine is slow to churn)
            print(f"warning: {e}", file=sys.stderr)
        time.sleep(3.0)
        save_screenshot(driver, out / "dashboard-50.png")
        once = run_status(swarm.initial_peers, folder.name)
        time.sleep(12.0)  # one more round of the watch, then it is stopped as Ctrl-C stops it (by its PID)
        watch.send_signal(signal.SIGINT)
        watch.wait(60)
        watched = watch_log.read_text()
        cmd_line = f"$ python -m swarm.status --initial-peers MADDR --model {folder.name}"
        (out / "status-50.txt").write_text(
            f"{cmd_line}\n{once.rstrip()}\n\n{cmd_line} --watch 10   # across the churn\n{watched.rstrip()}\n"
        )
        print(f"wrote {out / 'dashboard-50.png'} and {out / 'status-50.txt'}")
        return 0
    finally:
        if watch is not None and watch.poll() is None:  # stopped by its PID
            watch.kill()
            watch.wait(10)
        if driver is not None:
            driver.quit()
        swarm.stop()
        fork.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="where the PNGs go (default docs/)")
    p.add_argument("--prompt", default="In two sentences, what is a peer-to-peer network?")
    p.add_argument("--throughput", default="auto", help="the peers' --throughput ('auto' measures; a number skips it)")
    p.add_argument("--peers", type=int, default=3, help="3: the README's SmolLM2 swarm; more needs --model random48")
    p.add_argument("--model", choices=[MODEL, "random48"], default=MODEL)
    args = p.parse_args()
    if args.model == "random48":
        return big_swarm(args.peers, args.out)
    work = Path(tempfile.mkdtemp(prefix="swarm-screenshot-"))
    swarm = LocalSwarm(
        MODEL, ["0:15"], extra_args=("--throughput", args.throughput), log_dir=work / "logs", startup_timeout=STARTUP
    )
    api: ApiProcess | None = None
    driver = None
    try:
        swarm.start()
        swarm.add_peer("15:30", wait=False)
        swarm.add_peer("15:30", wait=False)
        for peer in swarm.peers:
            peer.wait_ready(STARTUP)
        api = ApiProcess(
            swarm.initial_peers,
            "--model",
            MODEL,
            test_timings=False,
            log_path=work / "api.log",
            startup_timeout=STARTUP,
        )
        base = api.url.rstrip("/")
        driver = chrome(work / "profile", 1400, 760)
        chat(driver, base, args.prompt, args.out)  # first, so the dashboard shows requests served
        driver.get(base + "/dashboard")
        everyone = {p.peer_id for p in swarm.peers}
        wait_until(lambda: map_peers(driver) >= everyone, 60, "the map to show every peer")
        time.sleep(2.0)  # one more live update, so the load columns are current
        save_screenshot(driver, args.out / "dashboard.png")
        print(f"wrote {args.out / 'dashboard.png'} and {args.out / 'chat.png'}")
        return 0
    finally:
        if driver is not None:
            driver.quit()
        if api is not None:
            api.stop()
        swarm.stop()


if __name__ == "__main__":
    sys.exit(main())
