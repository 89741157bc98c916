"""hydra/sweeper=grid (hydra_plugins/fedrun_grid_sweeper): Hydra's product with collapse rules."""

import pytest

from hydra_plugins.fedrun_grid_sweeper.grid_sweeper import (
    FedrunGridSweeper,
    check_excludes,
    check_rules,
    collapsed,
    excluded,
)

RULE = {"when": {"attack.count": 0}, "becomes": {"attack": "none"}, "drop": ["attack.count", "attack.fraction"]}


def product(attacks, counts, seeds=(0,)):
    return [
        [f"attack={a}", "attack.fraction=null", f"attack.count={c}", f"seed={s}"]
        for a in attacks
        for c in counts
        for s in seeds
    ]


def test_every_attack_at_count_zero_is_one_job_without_attack():
    jobs = product(["alie", "ipm"], [0, 2], seeds=(0, 1))
    kept, left_out = collapsed(jobs, [RULE])
    assert left_out == 2  # ipm's two count-0 jobs equal alie's, which became attack=none
    assert kept == [
        ["seed=0", "attack=none"],
        ["seed=1", "attack=none"],
        ["attack=alie", "attack.fraction=null", "attack.count=2", "seed=0"],
        ["attack=alie", "attack.fraction=null", "attack.count=2", "seed=1"],
        ["attack=ipm", "attack.fraction=null", "attack.count=2", "seed=0"],
        ["attack=ipm", "attack.fraction=null", "attack.count=2", "seed=1"],
    ]


def test_without_rules_it_is_the_basic_product_and_repeats_go_once():
    jobs = product(["alie"], [0, 2])
    assert collapsed(jobs, []) == (jobs, 0)
    assert collapsed(jobs + jobs[:1], []) == (jobs, 1)  # a job listed twice runs once


def test_values_match_as_an_override_writes_them():
    rule = {"when": {"flag": True, "x": None}, "becomes": {"y": 1}}
    assert collapsed([["flag=true", "x=null", "+y=2"]], [rule]) == ([["flag=true", "x=null", "y=1"]], 0)
    assert collapsed([["flag=false", "x=null"]], [rule]) == ([["flag=false", "x=null"]], 0)
    assert collapsed([["attack.count=0.0"]], [RULE])[0] == [["attack.count=0.0"]]  # the text, not the number


def test_excluded_jobs_are_left_out_with_their_reason():
    jobs = [[f"defence={d}", f"attack.count={c}"] for d in ("median", "median_bucketing") for c in (2, 6)]
    rule = {"when": {"defence": "median_bucketing", "attack.count": 6}, "why": "10 rows cannot hold f = 6"}
    kept, dropped = excluded(jobs, check_excludes([rule]))
    assert kept == jobs[:3] and dropped == [(1, "10 rows cannot hold f = 6")]
    assert excluded(jobs, []) == (jobs, [])
    with pytest.raises(ValueError, match="a list of"):
        check_excludes([{"why": "no when"}])


@pytest.mark.parametrize(
    "rules,match",
    [
        ({"when": {"a": 1}}, "a list"),
        ([{"becomes": {"a": 1}}], "needs `when`"),
        ([{"when": {"a": 1}, "then": {}}], "takes only when, becomes, drop"),
    ],
)
def test_bad_rules_are_one_line(rules, match):
    with pytest.raises(ValueError, match=match):
        check_rules(rules)


def test_the_sweeper_applies_its_rules_to_hydras_product():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(["attack=alie,ipm", "attack.count=0,2", "seed=0"])
    sweeper = FedrunGridSweeper(collapse=[RULE], max_batch_size=2)
    batches = sweeper.split_arguments(overrides, 2)
    assert [len(b) for b in batches] == [2, 1]  # 4 jobs, ipm's count 0 equal to alie's: 3 in batches of 2
    assert batches[0][0] == ["seed=0", "attack=none"]
