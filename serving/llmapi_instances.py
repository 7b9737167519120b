"""Several instances of the LLM-API `tensorrt_llm` model, each on its own GPU(s): which GPUs an
instance gets from the `gpu_device_ids` parameter (plain Python; no Triton import).

TensorRT-LLM's docs for this repository place instances with `instance_group [{count: K, kind:
KIND_CPU}]` and `gpu_device_ids` listing one group of GPU ids per instance, `;` between
instances and `,` inside one ("0;1": instance 0 on GPU 0, instance 1 on GPU 1). Each such
instance runs an engine of its own. Without `gpu_device_ids` several instances share one engine
(the five-model model's relay, serving/shared_engine.py).

An instance learns its index from the name Triton gives it: `<group name>_<c>` for the c-th
instance of a group (Triton's backend_model_instance.cc; older servers named a group's only
instance by the group name), the group name defaulting to `<model name>_<group index>`
(tensorrt_llm_0_1: group 0, instance 1). Indices count over the groups in config order.
"""
from __future__ import annotations

from typing import Any


def _fail(message: str) -> ValueError:
    return ValueError(f"gpu_device_ids: {message}")


def is_unset(value: str | None) -> bool:
    """Missing, empty, or a fill_template placeholder left unfilled."""
    return value is None or not value.strip() or value.strip().startswith("${")


def parse_gpu_device_ids(value: str, instance_count: int, tensor_parallel_size: int = 1) -> list[list[int]]:
    """"0;1" -> [[0], [1]]: one list of GPU ids per instance, checked against the instance count
    and tensor_parallel_size (ValueError naming gpu_device_ids and the fix). With pipeline stages
    the caller passes the instance's whole world, tensor_parallel_size x pipeline_parallel_size:
    an instance lists every device of its ranks."""
    groups = []
    for index, text in enumerate(value.split(";")):
        ids = []
        for item in text.split(","):
            item = item.strip()
            if not item.isdigit():
                raise _fail(f"{item!r} (instance {index}'s ids {text.strip()!r}) is not a GPU id; expected "
                            "non-negative integers, ',' between one instance's GPUs and ';' between instances, "
                            "e.g. \"0;1\"")
            ids.append(int(item))
        groups.append(ids)
    if len(groups) != instance_count:
        raise _fail(f"{value!r} places {len(groups)} instance(s), but instance_group has {instance_count}; give one "
                    "';'-separated group of GPU ids per instance (or leave gpu_device_ids unset: the instances then "
                    "share one engine)")
    for index, ids in enumerate(groups):
        if len(ids) != tensor_parallel_size:
            raise _fail(f"instance {index} lists {len(ids)} GPU(s) ({','.join(map(str, ids))}), but "
                        f"tensor_parallel_size is {tensor_parallel_size}; each instance lists tensor_parallel_size "
                        "GPU ids")
    if tensor_parallel_size > 1:
        # Leader mode: one engine over the job's ranks, rank r on cuda:<local rank r>.
        if instance_count > 1:
            raise _fail(f"{instance_count} instances with tensor_parallel_size {tensor_parallel_size} are not "
                        "supported: the launcher's ranks (--world_size) serve one engine; use one instance")
        if groups[0] != list(range(tensor_parallel_size)):
            raise _fail(f"{value!r}: with tensor_parallel_size {tensor_parallel_size} rank r runs on GPU r of its "
                        f"node, so the ids are {','.join(map(str, range(tensor_parallel_size)))}; choose the "
                        "physical GPUs with CUDA_VISIBLE_DEVICES")
    return groups


def instance_group_sizes(model_config: dict[str, Any], model_name: str) -> list[tuple[str, int]]:
    """(group name, instances) of each instance group, in config order. A KIND_GPU group with
    gpu_device_ids set is refused: placement comes from gpu_device_ids (as in the reference), and
    Triton names a KIND_GPU group's instances on different GPUs alike."""
    sizes = []
    for index, group in enumerate(model_config.get("instance_group") or [{}]):
        if group.get("kind", "KIND_CPU") == "KIND_GPU":
            raise _fail(f"instance group {index} is KIND_GPU; with gpu_device_ids use kind: KIND_CPU (each "
                        "instance's GPUs come from gpu_device_ids)")
        sizes.append((group.get("name") or f"{model_name}_{index}", int(group.get("count", 1) or 1)))
    return sizes


def instance_index(instance_name: str, sizes: list[tuple[str, int]]) -> int:
    """The index of the instance Triton named `instance_name`, counted over the groups `sizes`."""
    found, offset = [], 0
    for name, count in sizes:
        if instance_name == name and count == 1:
            found.append(offset)
        elif instance_name.startswith(name + "_"):
            c = instance_name[len(name) + 1:]
            if c.isdigit() and int(c) < count:
                found.append(offset + int(c))
        offset += count
    if len(found) != 1:
        groups = ", ".join(f"{name} ({count})" for name, count in sizes)
        raise _fail(f"cannot tell which instance {instance_name!r} is among the instance groups {groups}")
    return found[0]


def instance_gpu_ids(model_config: dict[str, Any], model_name: str, instance_name: str,
                     tensor_parallel_size: int = 1) -> list[int] | None:
    """The GPU ids of this instance from config.pbtxt's gpu_device_ids, or None when it is unset."""
    value = ((model_config.get("parameters") or {}).get("gpu_device_ids") or {}).get("string_value")
    if is_unset(value):
        return None
    sizes = instance_group_sizes(model_config, model_name)
    groups = parse_gpu_device_ids(value, sum(count for _, count in sizes), tensor_parallel_size)
    return groups[instance_index(instance_name, sizes)]
