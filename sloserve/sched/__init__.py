"""Instance scheduler: continuous batching, chunked prefill, preemption. Pure Python."""
from sloserve.sched.plan import Executor, ScheduledRequest, StepPlan, StepResult
from sloserve.sched.policies import POLICIES, SchedulingPolicy, make_policy
from sloserve.sched.scheduler import Scheduler, SchedulerStats
from sloserve.sched.state import InstanceState

__all__ = ["Executor", "InstanceState", "POLICIES", "ScheduledRequest", "Scheduler", "SchedulerStats", "SchedulingPolicy", "StepPlan", "StepResult", "make_policy"]
