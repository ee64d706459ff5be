# Stand-in for motoserver/moto:5.2.5: the same moto[server] release from PyPI
# (Makefile S3_PKG; its wheels fetched by run.sh) on bookworm's python3, with
# moto_server and a python3 that has boto3 first on PATH, as in that image.
ARG BASE
FROM ${BASE}
ARG S3_PKG
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null \
 && rm -rf /var/lib/apt/lists/*
COPY . /wheels
RUN python3 -m venv /opt/moto \
 && /opt/moto/bin/pip install -q --no-index --find-links /wheels "${S3_PKG}" && rm -rf /wheels
ENV PATH=/opt/moto/bin:$PATH
EXPOSE 5000
ENTRYPOINT ["moto_server", "-H", "0.0.0.0"]
