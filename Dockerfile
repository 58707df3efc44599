# Placeholder until the serving issue: a Debian 12 build image with burst's dependencies.
FROM debian:12
COPY scripts/setup.sh /opt/burst/scripts/setup.sh
RUN apt-get update && apt-get install -y --no-install-recommends sudo && true
WORKDIR /opt/burst
COPY . /opt/burst
RUN scripts/setup.sh && scripts/build.sh
CMD ["build/bin/burst-generate", "--model", "models/kjv-tiny", "--prompt", "And God said"]
