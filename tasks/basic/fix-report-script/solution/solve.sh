#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
sed -i 's/values.append(float(line)$/values.append(float(line))/; s/{totl:g}/{total:g}/' report.py
