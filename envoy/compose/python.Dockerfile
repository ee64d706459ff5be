# Stand-in for python:3.11-alpine (the render and upstream services): Debian
# bookworm's python3, 3.11, with the standard library only, as in that image.
ARG BASE
FROM ${BASE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 >/dev/null \
 && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
