"""Packaging beyond pyproject.toml (which holds the metadata): the model-repository templates.

A checkout keeps them at all_models/, the path NVIDIA's docs and clients use; the wheel installs
the same files as package data of tritonllm, tritonllm/all_models/ (tritonllm/paths.py finds them
in either place), so there is one copy of each file. ``package_dir`` maps the one folder into the
package; pyproject.toml cannot say that beside an automatic package search.
"""
from setuptools import find_namespace_packages, find_packages, setup

TEMPLATES = "tritonllm.all_models"
# Each folder of all_models is named as a package of its own (setuptools would otherwise warn that it
# leaves out files of folders Python could import), and carries all its files: config.pbtxt,
# 1/model.py, model.yaml, and ensemble/1/.tmp, which keeps the ensemble's version folder, which
# tritonserver requires, in git and in the wheel.
TEMPLATE_FOLDERS = [TEMPLATES, *(f"{TEMPLATES}.{name}" for name in find_namespace_packages(where="all_models"))]

setup(
    packages=[*find_packages(include=["engine*", "kernels*", "serving*", "openai_frontend*", "tritonllm*"]),
              *TEMPLATE_FOLDERS],
    package_dir={TEMPLATES: "all_models"},
    package_data={folder: ["*", ".*"] for folder in TEMPLATE_FOLDERS},
    exclude_package_data={folder: ["*.pyc"] for folder in TEMPLATE_FOLDERS},
)
