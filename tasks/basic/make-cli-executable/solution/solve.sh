#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
sed -i '1i #!/usr/bin/env python3' shout.py
chmod +x shout.py
