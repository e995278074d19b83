# Sourced by the container scripts: how podman is invoked on these machines.
# - runc, not crun: crun refuses hosts whose cgroup v2 hierarchy is mounted beside v1 controllers
#   ("cgroups in hybrid mode not supported"), which is how these machines are set up.
# - Explicit rlimits no higher than this shell's hard limits: podman's defaults ask for more,
#   and raising a hard limit needs CAP_SYS_RESOURCE, which this sandbox does not grant.
PODMAN=(podman --runtime runc)
_nofile=$(ulimit -Hn); [ "$_nofile" = unlimited ] && _nofile=1048576
_nproc=$(ulimit -Hu); { [ "$_nproc" = unlimited ] || [ "$_nproc" -gt 16384 ]; } && _nproc=16384
ULIMITS=(--ulimit "nofile=$_nofile:$_nofile" --ulimit "nproc=$_nproc:$_nproc")
