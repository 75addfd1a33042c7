"""DISTGEMM_AUTOTUNE is read once (every repeated GEMM asks whether tuning is on) and again on
reload_settings(), or set by distgemm.settings(autotune=...); needs_autograd's fast path agrees
with its definition."""

import torch

import distgemm
from distgemm import autotune
from distgemm._checks import needs_autograd


def test_setting_is_read_on_reload_only(monkeypatch):
    before = autotune.enabled()
    try:
        monkeypatch.setenv("DISTGEMM_AUTOTUNE", "0")
        assert autotune.enabled() == before  # not re-read per call
        distgemm.reload_settings()
        assert autotune.enabled() is False
        monkeypatch.setenv("DISTGEMM_AUTOTUNE", "1")
        distgemm.reload_settings()
        assert autotune.enabled() is True
        monkeypatch.delenv("DISTGEMM_AUTOTUNE")
        distgemm.reload_settings()
        assert autotune.enabled() is True  # on by default
        with distgemm.settings(autotune=False):
            assert autotune.enabled() is False
        assert autotune.enabled() is True
    finally:
        monkeypatch.undo()
        distgemm.reload_settings()


def test_needs_autograd():
    x, w = torch.ones(2, 2), torch.ones(2, 2, requires_grad=True)
    assert needs_autograd(x, w, None)
    assert not needs_autograd(x, x, None)
    assert not needs_autograd(x, "not a tensor", None)
    with torch.no_grad():
        assert not needs_autograd(x, w, None)
