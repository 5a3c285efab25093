"""`env.name: pi` for `jaxpi grpo`: the trainer imports this module, which registers the Pi task
source and collector with it.

    jaxpi grpo --config configs/grpo/tiny.yaml env.name=pi env.tasks_dir=tasks/basic ...
"""

from __future__ import annotations

from jaxpi.rl import trainer
from jaxpi.runner.collector import PiCollector, make_pi_env

if hasattr(trainer, "register_env"):
    trainer.register_env("pi", make_pi_env, PiCollector)
