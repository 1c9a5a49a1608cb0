"""The vocabulary every layer shares: requests, sampling parameters, QoS classes and the one SLO
type (`types`), engine and scheduler configs (`config`), the one finished-request record
(`records`), and what the cluster controller sees and decides (`fleet_view`). It reaches nothing
else of sloserve but the instance scheduler's load snapshot (`sched/state.py`), which the
controller's view of an instance carries."""
