"""The status page in a real headless browser, on a real ``coordinator serve`` with two sites
training: it shows the open round as rounds close, both sites, and charts with a point per
closed round. Debian's chromium, driven by playwright (never ``playwright install``); the
screenshot is kept in the test's folder, and in ``$ISTHMUS_ARTIFACTS`` when that is set
(``ISTHMUS_UPDATE_DOCS=1`` also writes ``docs/status_page.png``)."""

from __future__ import annotations

import os
import re
import shutil
import threading

import pytest

try:
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

import torch

from wire.proto import isthmus_pb2 as pb

pytestmark = pytest.mark.e2e
SITES = ("site-a", "site-b")
ROUNDS = 12
PACE_S = 0.6  # per round while the browser looks; then the sites hurry to the end


def chromium() -> str | None:
    for name in (os.environ.get("ISTHMUS_CHROMIUM"), "chromium", "chromium-browser"):
        if name and (found := shutil.which(name)):
            return found
    return None


def site(address: str, k: int, hurry: threading.Event, errors: list) -> None:
    """A lightweight site: each round fetch theta, report a falling loss, wait ``PACE_S``
    (unless hurried), push a small update; then the final fetch and leave."""
    from site_client.transfer.client import CoordinatorClient

    client = CoordinatorClient(address, SITES[k], backoff=h.FAST_BACKOFF, rpc_timeout_s=5.0)
    try:
        client.join()
        last, progress = -1, None
        while True:
            # The last round's progress until the next opens: the close reads the loss off it.
            info = client.wait_for_round(after=last, progress=progress, poll_s=0.05)
            if info.finished:
                break
            r, g = info.round, client.fetch()
            loss = 2.5 * 0.8**r + 0.05 * k
            progress = pb.Progress(round=r, inner_step=1, train_loss=loss, phase="train")
            client.heartbeat(progress)
            hurry.wait(PACE_S)
            delta = {n: torch.full_like(g.theta[n], 0.01) for n in h.TRAINABLE}
            client.push(r, delta, base_version=g.version)
            last = r
        client.fetch()
        client.leave("done")
    except BaseException as exc:
        errors.append(exc)
    finally:
        client.close()


def test_the_page_follows_a_live_two_site_job(tmp_path):
    exe = chromium()
    if exe is None:
        pytest.skip("no chromium binary: apt-get install -y chromium (or set ISTHMUS_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[dev]'")
    rounds = {"total": ROUNDS, "min_sites": 2, "max_sites": 2}
    folder = tmp_path / "job"
    folder.mkdir()
    coord = h.CoordinatorProcess(
        h.write_config(folder, h.job_config(name="pagejob", rounds=rounds)),
        folder / "state",
        folder / "coordinator.log",
        extra_args=("--status-page", "127.0.0.1:0"),
    )
    coord.start()
    url = f"http://{(folder / 'state' / 'status_page_address').read_text().strip()}/"
    hurry, errors = threading.Event(), []
    threads = [
        threading.Thread(target=site, args=(coord.address, k, hurry, errors), daemon=True)
        for k in range(len(SITES))
    ]
    shot = tmp_path / "status_page.png"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe)
            page = browser.new_page(viewport={"width": 1180, "height": 760})
            page.goto(url)
            # Waits poll from Python: the page's policy forbids the eval a JS predicate needs.
            h.wait_until(lambda: page.text_content("#job") == "pagejob", 10, 0.1, "the job")
            for t in threads:
                t.start()
            rows = page.locator("#sites tbody tr")
            h.wait_until(lambda: rows.count() == 2, 10, 0.1, "both sites")
            assert sorted(rows.locator("td:first-child").all_text_contents()) == list(SITES)
            first = _round(page.text_content("#round"))
            later = h.wait_until(
                lambda: _round(page.text_content("#round")) >= first + 2 or None,
                15, 0.1, "two rounds to close",
            )  # fmt: skip
            assert later  # the round shown changed, live
            circles = page.locator("#chart-loss circle")
            h.wait_until(lambda: circles.count() >= 3, 10, 0.1, "three points of loss")
            for chart in ("loss", "bytes", "seconds"):
                assert page.locator(f"#chart-{chart} circle").count() >= 3
            assert "train r" in page.text_content("#sites tbody")
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
    finally:
        hurry.set()
        for t in threads:
            t.join(60)
        code = coord.wait(timeout=30) if not errors else None
        coord.kill()
    assert not errors, f"{errors!r}\n{coord.log_tail()}"
    assert code == 0, coord.log_tail()
    _keep(shot)


def _round(text: str) -> int:
    m = re.match(r"(\d+)/", text)
    assert m, f"round shown as {text!r}"
    return int(m[1])


def _keep(shot) -> None:
    if out := os.environ.get("ISTHMUS_ARTIFACTS"):
        os.makedirs(out, exist_ok=True)
        shutil.copy(shot, os.path.join(out, shot.name))
    if os.environ.get("ISTHMUS_UPDATE_DOCS") == "1":
        shutil.copy(shot, h.REPO / "docs" / shot.name)
