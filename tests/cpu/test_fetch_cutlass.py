"""cmake/fetch_cutlass.py: the pinned CUTLASS headers are taken only from a wheel with the
pinned hash and a version.h of the pinned version, extracted once into the cache."""

import hashlib
import importlib.util
import io
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "cmake" / "fetch_cutlass.py"


@pytest.fixture
def fetch(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("fetch_cutlass", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("DISTGEMM_CACHE", str(tmp_path / "cache"))
    return module


def fake_wheel(version=(4, 5, 0)) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        major, minor, patch = version
        z.writestr("flashinfer/data/cutlass/include/cutlass/version.h",
                   f"#define CUTLASS_MAJOR {major}\n#define CUTLASS_MINOR {minor}\n#define CUTLASS_PATCH {patch}\n")
        z.writestr("flashinfer/data/cutlass/include/cute/tensor.hpp", "// cute\n")
        z.writestr("flashinfer/data/cutlass/tools/util/include/cutlass/util/device_memory.h", "// util\n")
        z.writestr("flashinfer/data/cutlass/examples/skip_me.cu", "// not a header we take\n")
        z.writestr("flashinfer/__init__.py", "")
    return buf.getvalue()


def serve(monkeypatch, fetch, data: bytes):
    def download(dest):
        path = Path(dest) / fetch.WHEEL_FILE
        path.write_bytes(data)
        return path
    monkeypatch.setattr(fetch, "download", download)


def test_extracts_only_the_headers_once(monkeypatch, fetch, capsys):
    data = fake_wheel()
    monkeypatch.setattr(fetch, "WHEEL_SHA256", hashlib.sha256(data).hexdigest())
    serve(monkeypatch, fetch, data)
    fetch.main()
    tree = Path(capsys.readouterr().out.strip())
    assert (tree / "include/cutlass/version.h").exists()
    assert (tree / "tools/util/include/cutlass/util/device_memory.h").exists()
    assert not (tree / "examples").exists() and not (tree / "flashinfer").exists()
    monkeypatch.setattr(fetch, "download", lambda dest: pytest.fail("downloaded again"))
    fetch.main()  # cached: no download
    assert Path(capsys.readouterr().out.strip()) == tree


def test_a_wheel_with_another_hash_is_refused(monkeypatch, fetch):
    serve(monkeypatch, fetch, fake_wheel())
    with pytest.raises(SystemExit, match="SHA-256"):
        fetch.main()
    assert not fetch.cache_dir().exists()


def test_a_wheel_with_another_cutlass_is_refused(monkeypatch, fetch):
    data = fake_wheel((4, 2, 0))
    monkeypatch.setattr(fetch, "WHEEL_SHA256", hashlib.sha256(data).hexdigest())
    serve(monkeypatch, fetch, data)
    with pytest.raises(SystemExit, match="carries CUTLASS"):
        fetch.main()
    assert not fetch.cache_dir().exists()
