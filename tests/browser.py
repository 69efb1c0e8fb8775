"""A page opened in a real browser for the tests: Debian's Chromium, headless, offline (no
network, no sync, no component updates), a fresh profile each time. `make browser-deps` installs
it; as root it is installed when missing, like tests/slurm_cluster.py's packages.

    dom = render(page, tmp_path / "page.png", (1280, 2000))
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
FLAGS += ["--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def chromium() -> str:
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("Chromium is not installed: run `make browser-deps` (apt-get, as root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", PACKAGE],
        check=True,
        env=env,
        capture_output=True,
    )
    return shutil.which("chromium") or "chromium"


def render(page: Path, png: Path, size: tuple[int, int]) -> str:
    """The page rendered at `size` (width, height) pixels into `png`; -> its DOM as the browser
    built it (after parsing: what it shows). One browser start for both."""
    with tempfile.TemporaryDirectory(prefix="mlmclm-chromium-") as profile:
        return subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
             f"--window-size={size[0]},{size[1]}", "--dump-dom", page.resolve().as_uri()],
            capture_output=True, text=True, timeout=180, check=True,
        ).stdout  # fmt: skip
