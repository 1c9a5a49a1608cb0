"""Fleet simulator: the real `sched/` and `kv/` code on modelled hardware, in simulated time."""
