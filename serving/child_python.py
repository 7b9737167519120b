"""The environment for a child ``python -m <package>`` of this project (engine.build, openai_frontend).

An installed wheel's packages are in site-packages, which every child interpreter of the same
environment finds. A source checkout's are found through the editable install's import hook, or,
when the checkout is not installed (``python3 scripts/launch_triton_server.py`` inserts it into
its own sys.path), not at all: so for a checkout the folder holding the packages goes on the
child's PYTHONPATH. Never for site-packages, which would then go ahead of the standard library.
"""
from __future__ import annotations

import os
import site
from pathlib import Path

PACKAGES_ROOT = Path(__file__).resolve().parents[1]  # the checkout, or site-packages


def installed_in_site_packages() -> bool:
    sites = site.getsitepackages() + [site.getusersitepackages()]
    return str(PACKAGES_ROOT) in {os.path.realpath(path) for path in sites}


def child_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) in which a child Python finds this project's packages."""
    env = dict(os.environ if base is None else base)
    if not installed_in_site_packages():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGES_ROOT), env.get("PYTHONPATH")) if p)
    return env
