"""Rollouts on a vLLM server: its venv, the server process, the rollout engine and adapter sync."""
