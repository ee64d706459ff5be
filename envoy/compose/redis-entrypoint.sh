#!/bin/sh
# As redis:7.0-alpine's entrypoint: redis-server started as root owns /data
# and runs as the redis user.
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
  set -- redis-server "$@"
fi
if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then
  find . \! -user redis -exec chown redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
