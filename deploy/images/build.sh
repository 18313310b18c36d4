#!/usr/bin/env bash
# Build kvroute's two images as OCI layouts, offline, FROM scratch, with Debian's umoci:
#   target/images/sidecar  kvroute-sidecar:VERSION — one static binary, /kvroute-sidecar, run as
#                          65532:65532, no shell, nothing else;
#   target/images/filter   kvroute-filter:VERSION — the wasm module as plugin.wasm in one layer
#                          (the "compat" Wasm image that Istio's and Envoy Gateway's fetchers take).
# Push with skopeo: skopeo copy oci:target/images/sidecar:VERSION docker://REGISTRY/kvroute/sidecar:VERSION
#
#   deploy/images/build.sh VERSION STATIC_SIDECAR_BINARY FILTER_WASM
set -euo pipefail
version=$1 sidecar=$2 wasm=$3
out=target/images
# umoci stamps each layer and history entry with a time: the commit's, so a rebuild of one
# commit differs only where the inputs do.
created=$(git log -1 --format=%cI 2>/dev/null || date -u +%Y-%m-%dT%H:%M:%SZ)
rm -rf "$out/sidecar" "$out/filter" "$out/work"
mkdir -p "$out/work"

image() { # NAME FILE PATH-IN-IMAGE MODE
  local name=$1 file=$2 path=$3 mode=$4 layout="$out/$1"
  umoci init --layout "$layout"
  umoci new --image "$layout:$version"
  umoci unpack --rootless --image "$layout:$version" "$out/work/$name"
  install -m "$mode" "$file" "$out/work/$name/rootfs/$path"
  umoci repack --history.created "$created" --history.created_by "deploy/images/build.sh" \
    --image "$layout:$version" "$out/work/$name"
}

image sidecar "$sidecar" kvroute-sidecar 0555
umoci config --image "$out/sidecar:$version" --created "$created" --no-history \
  --os linux --architecture amd64 \
  --config.user 65532:65532 --config.workingdir / \
  --config.entrypoint /kvroute-sidecar --config.cmd serve --config.cmd --config \
  --config.cmd /etc/kvroute/sidecar.toml \
  --config.label org.opencontainers.image.title=kvroute-sidecar \
  --config.label "org.opencontainers.image.version=$version"

image filter "$wasm" plugin.wasm 0444
umoci config --image "$out/filter:$version" --created "$created" --no-history \
  --os linux --architecture amd64 \
  --config.label org.opencontainers.image.title=kvroute-filter \
  --config.label "org.opencontainers.image.version=$version" \
  --manifest.annotation module.wasm.image/variant=compat
umoci gc --layout "$out/sidecar"
umoci gc --layout "$out/filter"
rm -rf "$out/work"
for name in sidecar filter; do
  echo "$out/$name:$version $(skopeo inspect --format '{{.Digest}}' "oci:$out/$name:$version")"
done
