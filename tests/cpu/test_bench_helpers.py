"""The benchmark helpers that decide what is timed and in which order (no GPU needed)."""

import os

import pytest

from distgemm.bench.common import parse_variants, shuffled, with_envs


def test_parse_variants_reads_names_and_settings():
    spec = "p2:DISTGEMM_TP_PIECES=2; p3t:DISTGEMM_TP_PIECES=3t,DISTGEMM_TP_ALGO=decomposed;"
    assert parse_variants(spec) == {
        "p2": {"DISTGEMM_TP_PIECES": "2"},
        "p3t": {"DISTGEMM_TP_PIECES": "3t", "DISTGEMM_TP_ALGO": "decomposed"},
    }
    assert parse_variants("") == {}


@pytest.mark.parametrize("spec", ["p2", "p2:", ":DISTGEMM_TP_PIECES=2", "p2:DISTGEMM_TP_PIECES"])
def test_parse_variants_refuses_malformed_specs(spec):
    with pytest.raises(ValueError, match="variant"):
        parse_variants(spec)


def test_shuffled_order_is_the_same_on_every_rank_and_changes_between_rounds():
    names = [f"impl{i}" for i in range(8)]
    orders = [shuffled(names, turn) for turn in range(5)]
    assert all(sorted(o) == names for o in orders)
    assert orders == [shuffled(names, turn) for turn in range(5)]  # what another rank computes
    assert len({tuple(o) for o in orders}) > 1
    # no column keeps the same predecessor in every round (the bias the rotating order had)
    for name in names:
        before = {o[o.index(name) - 1] if o.index(name) else None for o in orders}
        assert len(before) > 1


def test_with_envs_restores_the_previous_environment():
    os.environ["DISTGEMM_TEST_A"] = "old"
    os.environ.pop("DISTGEMM_TEST_B", None)
    seen = with_envs({"DISTGEMM_TEST_A": "new", "DISTGEMM_TEST_B": "set"},
                     lambda: (os.environ["DISTGEMM_TEST_A"], os.environ["DISTGEMM_TEST_B"]))()
    assert seen == ("new", "set")
    assert os.environ["DISTGEMM_TEST_A"] == "old" and "DISTGEMM_TEST_B" not in os.environ
    del os.environ["DISTGEMM_TEST_A"]
