"""The scheduler loop (trioshed.scheduler) with fake runners under MockClock."""
