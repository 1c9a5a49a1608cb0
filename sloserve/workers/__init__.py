"""Real instances: engine workers as local processes or Ray actors, and their health.

The counterpart of `sim/` for a real fleet: a worker is the ordinary single-instance server
(`sloserve.server.worker`) started in its own process or actor; `WorkerFleet` watches them,
replaces the dead, and asks the fleet controller (given to it, from `cluster/`) where a
request goes. Nothing here speaks the OpenAI API: that is the front's (`server/`).
"""
