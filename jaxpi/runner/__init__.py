"""Pi sessions as rollouts: Pi installed by the project, one sandboxed attempt per (task, level),
its record (see docs/pi.md). GRPO's collector over them is `jaxpi.rl.pi_env`."""
