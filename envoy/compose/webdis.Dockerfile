# Stand-in for nicolas/webdis:0.1.23: Debian bookworm's webdis (0.1.9), at
# the path the compose file runs (/usr/local/bin/webdis). The image's 0.1.23
# is not packaged; it was built from source and run under the e2e suites by
# hand (issue 44). 0.1.9 is the older of the two: the late reply to an
# abandoned call, fixed in 0.1.20, is still in it.
ARG BASE
FROM ${BASE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends webdis >/dev/null \
 && rm -rf /var/lib/apt/lists/* && ln -s /usr/bin/webdis /usr/local/bin/webdis
EXPOSE 7379
CMD ["/usr/local/bin/webdis", "/etc/webdis/webdis.json"]
