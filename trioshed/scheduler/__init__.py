"""The Trio side of scheduling: a loop over waiting requests, leases, runner lifetimes."""

from trioshed.scheduler.events import EventHistory, SchedulerEvent
from trioshed.scheduler.lease import Lease
from trioshed.scheduler.scheduler import Scheduler
from trioshed.scheduler.stats import RunnerStats, SchedulerStatistics

__all__ = ["EventHistory", "Lease", "RunnerStats", "Scheduler", "SchedulerEvent", "SchedulerStatistics"]
