#!/usr/bin/env bash
# The whole test suite: installs everything (venv, packages, Debian's SLURM), starts the local
# two-node SLURM cluster, runs pytest, stops the cluster. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
bash tests/slurm/cluster.sh start || { echo "test.sh: the local SLURM cluster did not start" >&2; exit 1; }
trap 'bash tests/slurm/cluster.sh stop' EXIT
.venv/bin/python -m pytest -q -p no:cacheprovider "${@:-tests}"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  rc=1
fi
exit "$rc"
