"""Cluster scheduler. The fleet controller (`controller.py`) decides and never executes, for the
real fleet and the simulated one alike, from one description (`spec.py`, FleetSpec) assembled
in one place (`assembly.py`, build_controller): which
instance serves a request (`routers/`), when a running request moves and where (`migration/`),
whether a prefilled request hands off to a decode instance (`handoff_pays`) or to another mixed
one (`mixed_handoff/`), how many instances each pool runs (`autoscale/`, reading `forecast/`),
and the output-length predictions some policies read (`predict.py`, `lengths.py`). Placement
policies of the simulator's studies sit beside them: pipeline stages (`stages/`) and MoE experts
(`experts/`).

The routers, the migration and mixed hand-off policies and `lengths.py` are pure Python (no
numpy, no torch): they run on every arrival and every control tick, a million times in a
simulated run. The controller imports `autoscale/`, whose forecasts are numpy arrays, so
importing it loads numpy; `predict.py` uses numpy and is consulted through a callable."""
