"""The vocabulary every layer shares: requests, sampling parameters, QoS classes and the one SLO
type (`types`), engine and scheduler configs (`config`) and the one finished-request record
(`records`). It imports nothing else of sloserve; what the controller sees of a fleet, which
carries the instance scheduler's load snapshot, is `sloserve/fleet_view.py`, above sched/."""
