"""A real front's fleet bookkeeping with no workers behind it: stand-in handles that are always running."""
from __future__ import annotations

from sloserve.workers.handles import WorkerHandle


class StandInHandle(WorkerHandle):
    url = "http://127.0.0.1:9"

    def is_running(self) -> bool:
        return True

    def kill(self) -> None:
        pass

    def describe(self) -> dict:
        return {}


def front_config(**settings):
    """A real fleet's FrontConfig from flat keywords, as tests write them: FleetSpec's fields go to
    its spec (with no predictor unless one is named), the others to the front."""
    from dataclasses import fields

    from sloserve.cluster.spec import FleetSpec
    from sloserve.workers.fleet import FrontConfig

    names = {f.name for f in fields(FleetSpec)}
    spec = {"predictor": "none", **{k: v for k, v in settings.items() if k in names}}
    return FrontConfig(FleetSpec(**spec), **{k: v for k, v in settings.items() if k not in names})


def sim_config(**settings):
    """A simulated fleet's FleetConfig from flat keywords, as tests write them: FleetSpec's fields
    go to its spec (with no predictor unless one is named), the others to the simulated fleet."""
    from dataclasses import fields

    from sloserve.cluster.spec import FleetSpec
    from sloserve.simulation import FleetConfig

    names = {f.name for f in fields(FleetSpec)}
    spec = {"predictor": "none", **{k: v for k, v in settings.items() if k in names}}
    return FleetConfig(FleetSpec(**spec), **{k: v for k, v in settings.items() if k not in names})
