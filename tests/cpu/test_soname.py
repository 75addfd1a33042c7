"""The installed package's C++ libraries carry the SONAME the README promises
(libdistgemm_core.so.0.<minor>: the C structs change layout only with a new soversion), under a
file of that name, and the binding records it: a program linked against a pip-installed
distgemm loads the soversion it was built for."""

import struct
from pathlib import Path

import pytest

import distgemm

PACKAGE = Path(distgemm.__file__).parent
MAJOR, MINOR = distgemm.__version__.split(".")[:2]
SOVERSION = f"{MAJOR}.{MINOR}"

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_SONAME = 0, 1, 5, 14


def dynamic_entries(path: Path) -> dict:
    """{'SONAME': str or None, 'NEEDED': [str]} of a 64-bit little-endian ELF shared object,
    read from its program headers (no readelf needed)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path} is not a 64-bit little-endian ELF"
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    assert dynamic is not None, f"{path} has no dynamic section"

    def file_offset(vaddr):
        for start, offset, size in loads:
            if start <= vaddr < start + size:
                return offset + vaddr - start
        raise AssertionError(f"address {vaddr:#x} is in no loaded segment of {path}")

    entries = []
    for pos in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == _DT_NULL:
            break
        entries.append((tag, value))
    strtab = file_offset(next(v for t, v in entries if t == _DT_STRTAB))

    def string(offset):
        end = data.index(b"\0", strtab + offset)
        return data[strtab + offset:end].decode()

    sonames = [string(v) for t, v in entries if t == _DT_SONAME]
    return {"SONAME": sonames[0] if sonames else None, "NEEDED": [string(v) for t, v in entries if t == _DT_NEEDED]}


def _installed(stem: str):
    return sorted(p for p in PACKAGE.iterdir() if p.name.startswith(stem + ".so"))


@pytest.mark.parametrize("stem", ["libdistgemm_core", "libdistgemm_nccl"])
def test_installed_libraries_carry_the_soname(stem):
    found = _installed(stem)
    if stem == "libdistgemm_nccl" and not found:
        pytest.skip("this build has no distgemm_nccl (NCCL was not found)")
    want = f"{stem}.so.{SOVERSION}"
    assert [p.name for p in found] == [want], f"expected one {want} in {PACKAGE}, found {[p.name for p in found]}"
    assert not found[0].is_symlink()
    assert dynamic_entries(found[0])["SONAME"] == want


def test_the_binding_loads_the_core_by_its_soname():
    needed = dynamic_entries(PACKAGE / "_C.so")["NEEDED"]
    assert f"libdistgemm_core.so.{SOVERSION}" in needed, needed


def test_the_cmake_package_points_at_the_soname():
    targets = "".join(p.read_text() for p in (PACKAGE / "lib" / "cmake" / "distgemm").glob("distgemmTargets*.cmake"))
    assert f'IMPORTED_SONAME_RELEASE "libdistgemm_core.so.{SOVERSION}"' in targets
    assert f'/distgemm/libdistgemm_core.so.{SOVERSION}"' in targets  # IMPORTED_LOCATION: the one file
