# shellcheck shell=bash
# Paths the scripts share. Source it before the script changes directory, so relative paths a
# caller sets are taken from where the script was started:
#   . "$(dirname "$0")/lib/paths.sh"
#
# Each of these, when set, is made absolute against that directory and exported, so cargo (which
# the scripts run from the checkout's root, where it would resolve a relative CARGO_TARGET_DIR),
# nested scripts and the binaries all see the same directory:
#   CARGO_TARGET_DIR  cargo's build directory (default: <checkout>/target)
#   LOXI_BIN_DIR      binaries to use instead of the release build (e.g. target/debug)
#   LOXI_SHARED       the shared/ directory (default: ../shared beside the checkout)
LOXI_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
for _var in CARGO_TARGET_DIR LOXI_BIN_DIR LOXI_SHARED; do
  if [ -n "${!_var:-}" ]; then
    export "$_var=$(realpath -m -- "${!_var}")"
  fi
done
unset _var

# The directory cargo puts release builds in: CARGO_TARGET_DIR/release, else target/release.
cargo_release_dir() { cargo_profile_dir release; }

# The directory cargo puts a PROFILE's builds in (`cargo build --profile PROFILE`): dev's is
# debug, any other profile's is its name (dist: the shipped build, see Cargo.toml).
cargo_profile_dir() {
  local dir=$1
  [ "$dir" = dev ] && dir=debug
  printf '%s\n' "${CARGO_TARGET_DIR:-$LOXI_ROOT/target}/$dir"
}

# proxy_bench_binaries SCRIPT PROFILE: builds what the proxy benches run (loxilb, echo-backend,
# hyper-floor) and sets LB_BIN_DIR (loxilb's directory) and BIN (the other two's). PROFILE pgo
# (what the container image ships): loxilb from scripts/build-pgo.sh, the others from dist;
# dist or release: the cargo profile of all three; anything else exits 2 naming SCRIPT. Run
# from the checkout's root.
proxy_bench_binaries() {
  local profile=$2
  LB_BIN_DIR=
  case "$profile" in
    pgo)
      LB_BIN_DIR=$(scripts/build-pgo.sh | tail -1)
      cargo build --profile dist -q -p loxi-tests --bin echo-backend --bin hyper-floor
      BIN=$(cargo_profile_dir dist)
      ;;
    dist | release)
      cargo build --profile "$profile" -q -p loxi-user --bin loxilb -p loxi-tests --bin echo-backend --bin hyper-floor
      BIN=$(cargo_profile_dir "$profile")
      LB_BIN_DIR=$BIN
      ;;
    *)
      echo "$1: BUILD_PROFILE must be pgo, dist or release (got '$profile')" >&2
      exit 2
      ;;
  esac
}

# The binaries a script runs after setup.sh's build: LOXI_BIN_DIR, else cargo_release_dir.
bin_dir() { printf '%s\n' "${LOXI_BIN_DIR:-$(cargo_release_dir)}"; }

# The shared/ directory: LOXI_SHARED, else ../shared beside the checkout.
shared_dir() { realpath -m -- "${LOXI_SHARED:-$LOXI_ROOT/../shared}"; }

# require_golden_tokenizer WHO: exits 1 with one message naming the path tried and LOXI_SHARED
# when shared/'s golden tokenizer (the demo's and benchmarks' model) is missing.
require_golden_tokenizer() {
  local tok where
  tok="$(shared_dir)/golden/tiny-model/tokenizer.json"
  [ -f "$tok" ] && return 0
  if [ -n "${LOXI_SHARED:-}" ]; then
    where="shared/ is taken from LOXI_SHARED=$LOXI_SHARED"
  else
    where="shared/ is ../shared beside the checkout unless LOXI_SHARED=DIR says otherwise"
  fi
  echo "$1: $tok not found: loxi's shared directory (golden tokenizer, spec, fixtures," \
    "eBPF toolchain script) is missing or incomplete ($where)" >&2
  exit 1
}

# need_value SCRIPT OPTION ARGC [VALUE]: exits 2 with a usage error when OPTION (which takes a
# value) is the last argument or is followed by an empty value or by another option (`--...`).
need_value() {
  if [ "$3" -lt 2 ] || [ -z "${4:-}" ] || [ "${4#--}" != "$4" ]; then
    echo "$1: $2 needs a value (see --help)" >&2
    exit 2
  fi
}
