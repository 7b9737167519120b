"""Several LLM-API `tensorrt_llm` instances placed by gpu_device_ids (serving/llmapi_instances.py),
without a server or GPUs: the parsing, the refusals, and which instance Triton's name is."""
from __future__ import annotations

import pytest

from serving.llmapi_instances import (instance_gpu_ids, instance_group_sizes, instance_index,
                                      parse_gpu_device_ids)


def model_config(gpu_device_ids=None, groups=({"count": 2, "kind": "KIND_CPU"},)):
    config = {"name": "tensorrt_llm", "instance_group": [dict(group) for group in groups]}
    if gpu_device_ids is not None:
        config["parameters"] = {"gpu_device_ids": {"string_value": gpu_device_ids}}
    return config


def test_semicolons_separate_instances_and_commas_one_instances_gpus():
    assert parse_gpu_device_ids("0;1", 2) == [[0], [1]]
    assert parse_gpu_device_ids(" 3 ; 1 ", 2) == [[3], [1]]
    assert parse_gpu_device_ids("0", 1) == [[0]]
    assert parse_gpu_device_ids("0,1", 1, tensor_parallel_size=2) == [[0, 1]]


@pytest.mark.parametrize("value, count, tp, expected", [
    ("0;1", 3, 1, "places 2 instance(s), but instance_group has 3"),
    ("0;1;2", 2, 1, "places 3 instance(s), but instance_group has 2"),
    ("0,1;2,3", 2, 1, "instance 0 lists 2 GPU(s) (0,1), but tensor_parallel_size is 1"),
    ("0", 1, 2, "instance 0 lists 1 GPU(s) (0), but tensor_parallel_size is 2"),
    ("0,1;2,3", 2, 2, "2 instances with tensor_parallel_size 2 are not supported"),
    ("2,3", 1, 2, "rank r runs on GPU r of its node, so the ids are 0,1"),
    ("0;gpu1", 2, 1, "'gpu1' (instance 1's ids 'gpu1') is not a GPU id"),
    ("0;-1", 2, 1, "'-1' (instance 1's ids '-1') is not a GPU id"),
    ("0;", 2, 1, "'' (instance 1's ids '') is not a GPU id"),
    ("0.5", 1, 1, "'0.5'"),
])
def test_refusals_name_gpu_device_ids_and_the_fix(value, count, tp, expected):
    with pytest.raises(ValueError) as error:
        parse_gpu_device_ids(value, count, tp)
    assert str(error.value).startswith("gpu_device_ids: ") and expected in str(error.value), str(error.value)


def test_instance_names_count_over_the_groups():
    """Triton names the c-th instance of a group `<group name>_<c>`, the group name defaulting to
    `<model>_<group index>` (older servers named a group's only instance by the group name)."""
    sizes = instance_group_sizes(model_config(groups=({"count": 2}, {"count": 1}, {"name": "big", "count": 3})),
                                 "tensorrt_llm")
    assert sizes == [("tensorrt_llm_0", 2), ("tensorrt_llm_1", 1), ("big", 3)]
    assert [instance_index(name, sizes) for name in ("tensorrt_llm_0_0", "tensorrt_llm_0_1", "tensorrt_llm_1_0",
                                                     "tensorrt_llm_1", "big_0", "big_2")] == [0, 1, 2, 2, 3, 5]
    for name in ("tensorrt_llm_0_2", "big_3", "other_0", "big"):
        with pytest.raises(ValueError, match=f"cannot tell which instance '{name}' is"):
            instance_index(name, sizes)


def test_each_instance_gets_its_group_of_ids():
    config = model_config("0;1")
    assert instance_gpu_ids(config, "tensorrt_llm", "tensorrt_llm_0_0") == [0]
    assert instance_gpu_ids(config, "tensorrt_llm", "tensorrt_llm_0_1") == [1]
    named = model_config("1;0", groups=({"name": "tensorrt_llm_0", "count": 2, "kind": "KIND_CPU"},))
    assert instance_gpu_ids(named, "tensorrt_llm", "tensorrt_llm_0_1") == [0]


@pytest.mark.parametrize("value", [None, "", "  ", "${gpu_device_ids}"])
def test_unset_keeps_the_shared_engine(value):
    assert instance_gpu_ids(model_config(value), "tensorrt_llm", "tensorrt_llm_0_1") is None


def test_kind_gpu_groups_are_refused_with_gpu_device_ids():
    config = model_config("0;1", groups=({"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]},))
    with pytest.raises(ValueError, match="gpu_device_ids: instance group 0 is KIND_GPU; .* use kind: KIND_CPU"):
        instance_gpu_ids(config, "tensorrt_llm", "tensorrt_llm_0_0")
