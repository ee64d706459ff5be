# Stand-in for nicolas/webdis:0.1.22: Debian bookworm's webdis (0.1.9), at
# the path the compose file runs (/usr/local/bin/webdis).
ARG BASE
FROM ${BASE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends webdis >/dev/null \
 && rm -rf /var/lib/apt/lists/* && ln -s /usr/bin/webdis /usr/local/bin/webdis
EXPOSE 7379
CMD ["/usr/local/bin/webdis", "/etc/webdis/webdis.json"]
