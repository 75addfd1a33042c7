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


def test_results_name_the_commit_the_build_was_made_from(monkeypatch):
    # An installed package has no .git: benchmark results take the commit the build recorded
    # (the README's install builds from a checkout), and the setting overrides it.
    import subprocess

    from distgemm import _build_info
    from distgemm.bench import common

    monkeypatch.setattr(_build_info, "COMMIT", "abc1234+", raising=False)
    monkeypatch.setattr(subprocess, "check_output", lambda *a, **k: (_ for _ in ()).throw(OSError("no git")))
    assert common.commit() == "abc1234+"
    with distgemm.settings(commit="def5678"):
        assert common.commit() == "def5678"
    monkeypatch.setattr(_build_info, "COMMIT", "", raising=False)
    assert common.commit() == "unknown"
