"""Real instances: engine workers and their health.

The counterpart of `sim/` for a real fleet. A worker is sloserve's single-instance server
(`sloserve.server.worker`) in its own process or Ray actor (`handles.py`), a stock vLLM server
(`vllm_process.py`), or a server started elsewhere that the front attaches to by URL;
`source.py` says which a fleet has. `kinds/` holds how the fleet speaks to each kind of server
(its load and cache, tokenizing, the body of a call, what its streams carry). `fleet.py`'s
`WorkerFleet` watches them, replaces the dead, and asks the fleet controller (given to it, from
`cluster/`) where a request goes; `contract.py` is what a front and sloserve's workers agree on.
Nothing here serves the OpenAI API: that is the front's (`front/`).
"""
