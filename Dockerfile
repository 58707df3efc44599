# Placeholder (the deployment issue owns the real images and docker-compose.yml): a Debian 12
# image that builds burst with scripts/setup.sh + scripts/build.sh and serves the embedded
# default. Without /usr/local/cuda in the image the CUDA parts are skipped. Not built here: this
# machine has no Docker engine.
FROM debian:12
WORKDIR /opt/burst
COPY . /opt/burst
RUN scripts/setup.sh && scripts/build.sh
EXPOSE 8080 50051
CMD ["build/bin/burst-server", "--config", "configs/cpu-tiny.json", "--host", "0.0.0.0"]
