#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
cat > text_tools.py <<'EOF'
def is_palindrome(text: str) -> bool:
    # Keep letters and digits only, compared case-insensitively.
    kept = [c.lower() for c in text if c.isalnum()]
    return kept == kept[::-1]
EOF
