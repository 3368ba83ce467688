# Sourced by the device_run_*.sh scripts: the set-up of one device call and its steps.
#
#   source "$(dirname "$0")/device_steps.sh" "$out"
#
# Makes OUT, records the GPU (OUT/gpu.txt), installs the tree (no dependencies: the device has them), and
# defines step NAME SECONDS COMMAND...: run COMMAND under a time limit, its output in
# OUT/NAME.txt, so that a slow step leaves the later ones their time and the earlier ones their
# results.
out=${1:?usage: source device_steps.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
# The install's log stays on the machine (printed if it fails): at most 8 files come back from OUT.
install_log=$(mktemp)
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$install_log" 2>&1 || cat "$install_log"

step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name ($*)"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "   exit $?"
}
