"""Plans: JSON round trip, validation, and the errors of bad plans."""

import json

import pytest

from advisor.compressors import CompressorConfig
from advisor.runtime import Plan, PlanGroup
from advisor.runtime.plan import exchange_groups


def mixed() -> Plan:
    return Plan.from_assignments(
        {"fc1.weight": "powersgd(rank=4)", "fc2.weight": "topk(ratio=0.01)", "fc2.bias": "topk:0.01"},
        default="fp16",
        warmup_steps=5,
        metadata={"made_by": "test"},
    )


def test_a_plan_round_trips_through_json_files(tmp_path):
    plan = mixed()
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again == plan
    assert again.config_for("fc2.bias") == CompressorConfig("topk", {"ratio": 0.01})
    assert again.config_for("anything.else") == CompressorConfig("fp16")
    assert again.digest() == plan.digest()


def test_parameters_with_equal_configs_share_a_group():
    assert sorted(len(g.parameters) for g in mixed().groups) == [1, 2]


def test_the_digest_ignores_metadata_but_not_what_goes_on_the_wire():
    a, b = mixed(), mixed()
    b.metadata["note"] = "other"
    assert a.digest() == b.digest()
    c = Plan.from_assignments({"fc1.weight": "powersgd(rank=2)"}, default="fp16", warmup_steps=5)
    assert c.digest() != a.digest()


def test_a_bucket_layout_goes_on_the_wire_and_round_trips_and_plans_without_one_keep_their_digest():
    plan = mixed()
    assert "exchange_mb" not in plan.to_dict()  # the digest of every plan made before layouts is unchanged
    merged = Plan.from_dict({**plan.to_dict(), "exchange_mb": 16})
    assert merged.exchange_mb == 16.0 and Plan.from_dict(merged.to_dict()) == merged
    assert merged.digest() != plan.digest()


def test_buckets_are_exchanged_together_until_they_hold_the_layouts_size_and_the_last_ends_a_group():
    mib = 1 << 20
    sizes = [1 * mib, 3 * mib, 5 * mib, 1 * mib, 1 * mib]
    assert exchange_groups(sizes, None) == [[0], [1], [2], [3], [4]]
    assert exchange_groups(sizes, 4) == [[0, 1], [2], [3, 4]]
    assert exchange_groups(sizes, 1000) == [[0, 1, 2, 3, 4]]
    assert exchange_groups(sizes, 0.5) == [[0], [1], [2], [3], [4]]


def test_runs_split_a_bucket_where_the_compressor_changes():
    plan = mixed()
    runs = plan.runs(["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"], [(10,), (10, 5), (5,), (5, 3)])
    assert [(names, config.label) for names, _, config in runs] == [
        (["fc2.bias", "fc2.weight"], "topk(ratio=0.01)"),
        (["fc1.bias"], "fp16"),
        (["fc1.weight"], "powersgd(rank=4)"),
    ]


def test_names_missing_from_the_model_are_listed_with_a_hint():
    with pytest.raises(ValueError, match="plan names 1 parameter\\(s\\) missing from the model: 'fc2.bias'"):
        mixed().check_against(["fc1.weight", "fc2.weight", "head.weight"])


@pytest.mark.parametrize(
    "change,message",
    [
        ({"version": 7}, "plan version 7 is not supported"),
        ({"kind": "something/else"}, "not a plan: 'kind' is 'something/else'"),
        ({"warmup_steps": -1}, "warmup_steps=-1; allowed: an integer >= 0"),
        ({"colour": "red"}, "plan has unknown field\\(s\\) \\['colour'\\]"),
        ({"groups": [{"parameters": ["a"]}]}, "plan group 0 must be an object with 'parameters' and 'compressor'"),
        ({"groups": [{"parameters": ["a"], "compressor": {"name": "topk", "params": {"ratio": 2}}}]},
         "plan group 0 \\(a\\): topk: ratio=2.0 is invalid; allowed: a number in \\(0, 1\\]"),
        ({"exchange_mb": 0}, "exchange_mb=0; allowed: a size in MiB > 0"),
        ({"exchange_mb": "big"}, "exchange_mb='big'; allowed: a size in MiB > 0"),
        ({"groups": [{"parameters": ["a"], "compressor": {"name": "fp16"}},
                     {"parameters": ["a"], "compressor": {"name": "bf16"}}]},
         "parameter 'a' is in plan groups 0 and 1"),
    ],
)
def test_bad_plans_name_the_problem(change, message):
    data = mixed().to_dict()
    data.update(change)
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(data)


def test_unreadable_files_say_so(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(ValueError, match="bad.json: plan is not valid JSON"):
        Plan.load(bad)
    with pytest.raises(ValueError, match="plan file .* does not exist"):
        Plan.load(tmp_path / "nope.json")
    (tmp_path / "list.json").write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="a plan must be a JSON object"):
        Plan.load(tmp_path / "list.json")


def test_a_group_with_an_unknown_compressor_names_its_parameters():
    with pytest.raises(ValueError, match="plan group of w1 and 1 more: unknown compressor 'zip'"):
        PlanGroup(("w1", "w2"), "zip")
