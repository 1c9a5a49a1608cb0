"""Cluster scheduler: which instance serves a request (routing, `routers/`), with the output-length
predictions some policies use (`predict.py`, `lengths.py`). Autoscaling, migration and disaggregation to come.

The routers and `lengths.py` are pure Python (no numpy, no torch): they run on every arrival, a
million times in a simulated run. `predict.py` uses numpy and is consulted through a callable."""
