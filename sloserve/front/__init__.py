"""The multi-instance front (`sloserve serve --instances N`): one OpenAI API over a fleet of engine
workers. app.py (the Front: judge, route, proxy), relay.py and stream.py (a client's stream across
instances), whole.py (a non-streamed call relayed as a stream), edge.py (admission at the front),
migration.py, handoff.py, autoscale.py and adapters.py (the controller's decisions carried out on
real workers), fanout.py, responses.py, and multi.py (assembles and runs it all from a FleetSpec).
The workers themselves are the single-instance server (`sloserve/server/`) with /internal/* routes;
their handles live in `sloserve/workers/`."""
