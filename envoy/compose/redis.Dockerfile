# Stand-in for redis:7.0-alpine: Debian bookworm's redis-server (7.0) and
# redis-cli, run as the image runs them: working directory /data (where the
# append-only file goes), started as root, which takes /data and drops to the
# redis user (redis-entrypoint.sh, as that image's docker-entrypoint.sh).
ARG BASE
FROM ${BASE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
 && rm -rf /var/lib/apt/lists/* && mkdir /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /data
WORKDIR /data
ENTRYPOINT ["docker-entrypoint.sh"]
EXPOSE 6379
CMD ["redis-server"]
