#!/bin/sh
# As valkey/valkey's docker-entrypoint.sh: flags (or a .conf file) first mean
# valkey-server's; started as root, it owns the working directory (/data)
# and runs as the valkey user, with umask 0077 unless one was set; the
# image's VALKEY_EXTRA_FLAGS are appended.
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
  set -- valkey-server "$@"
fi
if [ "$1" = valkey-server ] && [ "$(id -u)" = 0 ]; then
  find . \! -user valkey -exec chown valkey '{}' +
  exec setpriv --reuid=valkey --regid=valkey --clear-groups -- "$0" "$@"
fi
if [ "$(umask)" = 0022 ]; then
  umask 0077
fi
# Unquoted on purpose: the variable holds several flags.
# shellcheck disable=SC2086
exec "$@" $VALKEY_EXTRA_FLAGS
