"""Pi sessions as rollouts: Pi installed by the project, one sandboxed attempt per (task, level), the
GRPO collector over them (see docs/pi.md)."""
