"""Prints the path of a CUTLASS 4.5.0 header tree, fetching it on first use.

The nvidia-cutlass wheel stops at 4.2, whose Hopper block-scaled FP8 mainloop keeps a full
second accumulator (small tiles only). CUTLASS 4.5.0's include/ and tools/util/include/ ship,
unmodified, inside the flashinfer-python wheel pinned below; we take only those headers,
checked by the wheel's SHA-256 and by version.h, and cache them under
$DISTGEMM_CACHE (default ~/.cache/distgemm). The wheel is downloaded without its dependencies
(they would move torch and NCCL). Offline machines set CUTLASS_DIR instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

WHEEL_PROJECT = "flashinfer-python"
WHEEL_VERSION = "0.7.2.post1"
WHEEL_FILE = "flashinfer_python-0.7.2.post1-py3-none-any.whl"
WHEEL_SHA256 = "bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49"
PREFIX = "flashinfer/data/cutlass/"
PARTS = ("include/", "tools/util/include/")
CUTLASS_VERSION = (4, 5, 0)


def cache_dir() -> Path:
    root = Path(os.environ.get("DISTGEMM_CACHE", Path.home() / ".cache" / "distgemm"))
    return root / f"cutlass-{'.'.join(map(str, CUTLASS_VERSION))}-{WHEEL_SHA256[:12]}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(dest: Path) -> Path:
    """The wheel via pip (honours the user's index and proxy settings), else from PyPI."""
    spec = f"{WHEEL_PROJECT}=={WHEEL_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), spec]
    if subprocess.run(cmd, stdout=sys.stderr).returncode == 0 and (dest / WHEEL_FILE).exists():
        return dest / WHEEL_FILE
    with urllib.request.urlopen(f"https://pypi.org/pypi/{WHEEL_PROJECT}/{WHEEL_VERSION}/json",
                                timeout=60) as r:
        urls = [u["url"] for u in json.load(r)["urls"] if u["filename"] == WHEEL_FILE]
    if not urls:
        raise SystemExit(f"{WHEEL_FILE} is not on PyPI")
    with urllib.request.urlopen(urls[0], timeout=600) as r, open(dest / WHEEL_FILE, "wb") as f:
        shutil.copyfileobj(r, f)
    return dest / WHEEL_FILE


def version_of(tree: Path):
    text = (tree / "include/cutlass/version.h").read_text()
    get = lambda name: int(text.split(f"#define CUTLASS_{name} ")[1].split()[0])
    return get("MAJOR"), get("MINOR"), get("PATCH")


def main() -> None:
    target = cache_dir()
    if (target / "include/cutlass/version.h").exists():
        print(target)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = download(Path(tmp))
        got = sha256(wheel)
        if got != WHEEL_SHA256:
            raise SystemExit(f"{wheel.name}: SHA-256 {got}, expected {WHEEL_SHA256}")
        tree = Path(tmp) / "cutlass"
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                rel = name[len(PREFIX):]
                if name.startswith(PREFIX) and rel.startswith(PARTS) and not name.endswith("/"):
                    out = tree / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(z.read(name))
        if version_of(tree) != CUTLASS_VERSION:
            raise SystemExit(f"{wheel.name} carries CUTLASS {version_of(tree)}, expected {CUTLASS_VERSION}")
        try:
            tree.rename(target)
        except OSError:  # another build got there first
            if not (target / "include/cutlass/version.h").exists():
                raise
    print(target)


if __name__ == "__main__":
    main()
