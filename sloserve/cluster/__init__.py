"""Cluster scheduler: the fleet controller (`controller.py`) with which instance serves a request
(routing, `routers/`), when a running request moves and where (migration, `migration/`), and the
output-length predictions some policies use (`predict.py`, `lengths.py`). Autoscaling and
disaggregation to come.

The routers, the migration policies, the controller and `lengths.py` are pure Python (no numpy, no
torch): they run on every arrival and every control tick, a million times in a simulated run.
`predict.py` uses numpy and is consulted through a callable."""
