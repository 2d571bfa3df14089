"""loadtests.multiturn's ratios, from per-turn TTFTs (pure; exact values)."""

import pytest

from loadtests.multiturn import turn_ratios


def test_ratios_at_turns_from_four_are_the_median_of_per_turn_ratios():
    table = {
        "recompute": [40, 100, 200, 300, 400, 500, 600, 700],
        "l2": [50, 50, 50, 100, 50, 100, 100, 70],
        "l3": [60, 60, 60, 60, 80, 100, 120, 140],
    }
    ratios = turn_ratios(table)
    # turns 4-8: l2 3, 8, 5, 6, 10 -> median 6; l3 5, 5, 5, 5, 5 -> 5
    assert ratios["recompute_over_l2_turns_ge4"] == pytest.approx(6.0)
    assert ratios["recompute_over_l3_turns_ge4"] == pytest.approx(5.0)
    assert ratios["miss_cost_turn1_l2_over_recompute"] == pytest.approx(50 / 40)
    assert set(ratios) == {
        "recompute_over_l2_turns_ge4", "recompute_over_l3_turns_ge4", "miss_cost_turn1_l2_over_recompute"
    }


def test_no_recompute_run_gives_no_reuse_ratios_and_the_peer_comparisons_stand():
    table = {"stateless": [10, 10, 10, 40, 40, 40], "l1": [10, 10, 10, 10, 20, 40], "responses": [10] * 6}
    ratios = turn_ratios(table)
    assert ratios["stateless_over_l1_turns_ge4"] == pytest.approx(2.0)  # 4, 2, 1
    assert ratios["stateless_over_responses_turns_ge4"] == pytest.approx(4.0)
    assert ratios["responses_over_l1_turns_ge4"] == pytest.approx(0.5)  # 1, 0.5, 0.25
    assert not any(k.startswith("recompute") or k.startswith("miss") for k in ratios)


def test_fewer_than_four_turns_give_only_the_miss_cost():
    assert turn_ratios({"recompute": [40, 80, 120], "l2": [44, 20, 20]}) == {
        "miss_cost_turn1_l2_over_recompute": pytest.approx(1.1)
    }
