"""CLI start-up benchmark: how long `obliviate --help` and `obliviate ledger verify --help`
take, as a user runs them (a fresh process each time).

    python tests/bench/bench_cli.py [--quick] [--runs N]

Each command runs N times (default 15; --quick: 5) as a subprocess of the installed
`obliviate` entry point; the median wall time is reported. Targets: 1.0 s for
`--help`, 1.5 s for `ledger verify --help` on this project's loaded 2-core machine
(both used to take 15-35 s, when the command line imported torch and SciPy at start).
Exits 1 when a median misses its target.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGETS = {"cli_help_s": 1.0, "ledger_verify_help_s": 1.5}


def entry_point() -> list[str]:
    script = Path(sys.executable).parent / "obliviate"
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


def median_wall_s(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, timeout=120)
        times.append(time.perf_counter() - t0)
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {out.returncode}: "
                             f"{out.stderr.decode()[-2000:]}")
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 runs per command instead of 15")
    ap.add_argument("--runs", type=int, default=None)
    args = ap.parse_args()
    runs = args.runs or (5 if args.quick else 15)
    cli = entry_point()
    median_wall_s([*cli, "--help"], 1)  # warm the file cache and the .pyc files once
    result = {"cli_help_s": median_wall_s([*cli, "--help"], runs),
              "ledger_verify_help_s": median_wall_s([*cli, "ledger", "verify", "--help"], runs)}
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items())
          + f" runs={runs}")
    missed = [f"{k} {result[k]:.3f} s > {t} s" for k, t in TARGETS.items() if result[k] > t]
    for m in missed:
        print(f"MISSED {m}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
