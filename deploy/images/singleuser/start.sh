#!/bin/sh
# Entry point of the Infinijup single-user image (under tini, as root: singleuser.uid: 0).
#
# 1. Start Infinijup's privileged helper in this container. It starts, dumps and restores this
#    user's kernels, so it must share their filesystem, PID namespace and devices (the GPU):
#    that is why it runs here and not as a node DaemonSet (docs/kubernetes.md). It gets a clean
#    environment, logs to the container's log, and sits in its own session: the pod's SIGTERM
#    (tini -g) reaches the server only, which hibernates its kernels through the helper.
# 2. Bring the user's snapshot store back from the remote where the home has none
#    (restore_store.py, as the user; only when INFINIJUP_REMOTE is set).
# 3. Run the Jupyter server (the image's CMD) as the notebook user with no capability in any
#    set, the bounding set included, and no_new_privs: nothing the user runs can gain the
#    helper's privileges.
set -eu

NB_USER=${NB_USER:-jovyan}
NB_UID=${NB_UID:-1000}
NB_GID=${NB_GID:-100}
NB_HOME=${NB_HOME:-/home/$NB_USER}
socket=${INFINIJUP_HELPER_SOCKET:-/run/infinijup/helper.sock}
work=${INFINIJUP_HELPER_WORK:-/var/lib/infinijup/work}
helper=${INFINIJUP_HELPER_BIN:-/opt/infinijup/helper/bin/infinijup-helper}
restore_store=/usr/local/lib/infinijup/restore_store.py

if [ "$(id -u)" -ne 0 ]; then
  echo "infinijup-start: the container must start as root (singleuser.uid: 0); the server" \
       "then runs as $NB_USER" >&2
  exit 1
fi
if [ ! -s "$work/.seal-key" ]; then
  echo "infinijup-start: no seal key in $work (the infinijup-seal-key init container copies it" \
       "there from the Secret); without the cluster's key, no snapshot of an earlier pod" \
       "would restore here" >&2
  exit 1
fi

# The socket's directory must be root's and writable by nobody else (the helper checks).
install -d -m 0755 -o 0 -g 0 "$(dirname "$socket")"
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  "$helper" --daemon --socket "$socket" --work "$work" \
  --pidfile "$(dirname "$socket")/helper.pid" --log /dev/stderr

as_user() {
  exec setpriv --reuid="$NB_UID" --regid="$NB_GID" --init-groups --inh-caps=-all \
    --bounding-set=-all --no-new-privs -- \
    env HOME="$NB_HOME" USER="$NB_USER" LOGNAME="$NB_USER" "$@"
}

cd "$NB_HOME"
if [ -n "${INFINIJUP_REMOTE:-}" ]; then
  # Never keeps the server from starting: it says what went wrong, and a later start retries.
  (as_user python "$restore_store") || true
fi
as_user "$@"
