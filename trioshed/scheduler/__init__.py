"""The Trio side of scheduling: a loop over waiting requests, leases, runner lifetimes."""

from trioshed.scheduler.scheduler import Lease, RunnerStats, Scheduler, SchedulerStatistics

__all__ = ["Lease", "RunnerStats", "Scheduler", "SchedulerStatistics"]
