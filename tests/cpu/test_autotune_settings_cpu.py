"""DISTGEMM_AUTOTUNE is read once (every repeated GEMM asks whether tuning is on) and again on
reload_settings(); needs_autograd's fast path agrees with its definition."""

import torch

from distgemm import autotune
from distgemm._library import needs_autograd


def test_setting_is_read_on_reload_only(monkeypatch):
    monkeypatch.setattr(autotune, "_ENABLED", autotune._ENABLED)  # restored after the test
    monkeypatch.setenv("DISTGEMM_AUTOTUNE", "0")
    assert autotune.enabled() == autotune._ENABLED  # not re-read per call
    autotune.reload_settings()
    assert autotune.enabled() is False
    monkeypatch.setenv("DISTGEMM_AUTOTUNE", "1")
    autotune.reload_settings()
    assert autotune.enabled() is True
    monkeypatch.delenv("DISTGEMM_AUTOTUNE")
    autotune.reload_settings()
    assert autotune.enabled() is True  # on by default


def test_needs_autograd():
    x, w = torch.ones(2, 2), torch.ones(2, 2, requires_grad=True)
    assert needs_autograd(x, w, None)
    assert not needs_autograd(x, x, None)
    assert not needs_autograd(x, "not a tensor", None)
    with torch.no_grad():
        assert not needs_autograd(x, w, None)
