"""The request routers alive in this process, by (application, deployment).

Ray Serve ships a custom router class to each handle's process by value (cloudpickle), so a registry
kept on the class itself would be a copy that the rest of the process never sees; this module is
imported by name on both sides and so is shared. The ingress reads, through the router of its handle
to the LLM replicas, which replicas are running and the stats they last reported.
"""

from __future__ import annotations

import weakref
from typing import Any

_routers: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()


def register(app_name: str, deployment_name: str, router: Any) -> None:
    """Record the router this process uses for a deployment (the latest one wins)."""
    _routers[(app_name, deployment_name)] = router


def router_of(app_name: str, deployment_name: str) -> Any | None:
    """This process's router for a deployment, once a handle to it has started routing."""
    return _routers.get((app_name, deployment_name))
