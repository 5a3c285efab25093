#!/bin/bash
# Verifier: exit 0 = pass. Runs in the workspace; this directory is /tests (read-only).
set -euo pipefail
exec python3 /tests/check.py
