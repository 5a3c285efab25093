"""Record the Pi session fixtures: `python tools/record_pi_sessions.py [--out DIR] [--versions 1.6.0,0.73.1]`.

Each release runs a real, sandboxed attempt against `jaxpi serve` on a tiny scripted checkpoint;
its session file, event stream and the gateway's token-exact call records land in DIR/<version>/.
Needs bubblewrap, npm and the registry (Pi is installed under --work). The logic lives in
`jaxpi.testing.pi_record`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpi.runner.install import RELEASES
from jaxpi.testing.pi_record import record

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "pi_sessions"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=FIXTURES, help=f"fixture directory (default {FIXTURES})")
    p.add_argument("--versions", default=",".join(sorted(RELEASES, reverse=True)), help="Pi releases")
    p.add_argument("--work", type=Path, default=Path("/tmp/jaxpi-record"), help="Pi prefixes, checkpoint")
    args = p.parse_args()
    for version in args.versions.split(","):
        meta = record(version, args.out, args.work)
        print(f"{version}: {args.out / version} ({meta['recorded']})")


if __name__ == "__main__":
    main()
