# shellcheck shell=bash
# Sourced by scripts/test_deploy.sh and scripts/check_cuda_image.sh (not run on its own).
# make_debian_base DIR: a Debian 12 minbase root made by debootstrap from the mirror apt uses
# here (no image registry is reachable), with the host's apt sources, imported into $DOCKER as
# localhost/debian:bookworm; DIR is scratch space. Returns 1 after the tail of debootstrap's
# log when debootstrap fails.
make_debian_base() {
  local dir=$1 mirror
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  else
    mirror=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list)
  fi
  debootstrap --variant=minbase bookworm "$dir/rootfs" "$mirror" >"$dir/debootstrap.log" 2>&1 ||
    { tail -20 "$dir/debootstrap.log"; return 1; }
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    cp /etc/apt/sources.list.d/debian.sources "$dir/rootfs/etc/apt/sources.list.d/"
    rm -f "$dir/rootfs/etc/apt/sources.list"
  fi
  rm -rf "$dir"/rootfs/var/cache/apt/archives/*.deb "$dir"/rootfs/var/lib/apt/lists/*
  tar -C "$dir/rootfs" --numeric-owner -c . |
    "$DOCKER" import -c 'CMD ["/bin/bash"]' -c 'ENV LANG=C.UTF-8' - localhost/debian:bookworm \
      >/dev/null
  rm -rf "$dir/rootfs"
}
