"""Rollouts past one machine: GRPO collections on a Ray cluster (`collect.backend=ray`).

cluster.py     join (or start) the Ray cluster; the trainer's XLA settings for the workers
worker.py      a rollout worker: its own engine on the run's base, waves by adapter version
collector.py   FleetCollector: waves spread over the workers, faults, async submission, metrics
pi.py          Pi attempts as Ray tasks, each in its own sandbox, against the run's gateway
"""
