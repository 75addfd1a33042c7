"""The package refuses, at import, compiled libraries from another build."""

import types

import pytest

import distgemm
from distgemm import _library


def test_libraries_and_package_come_from_one_build():
    from distgemm._build_info import BUILD_ID

    assert list(_library.ops.build_ids()) == [BUILD_ID, BUILD_ID]


@pytest.mark.parametrize("ids", [("other", "other"), (None, None), ("same", "other")])
def test_a_stale_library_is_a_clear_import_error(monkeypatch, ids):
    from distgemm._build_info import BUILD_ID

    binding, core = (BUILD_ID if i is None else i for i in ids)
    if binding == core == BUILD_ID:
        binding = "stale"
    monkeypatch.setattr(_library, "ops", types.SimpleNamespace(build_ids=lambda: [binding, core]))
    with pytest.raises(ImportError, match="stale compiled library.*reinstall"):
        _library._check_build()
    assert distgemm.gemm  # the real module is untouched
