#!/usr/bin/env bash
# Download flash-attn-4 (FA4, CuTe DSL) and the wheels it needs that the GPU machines lack, so that they can be
# carried there: the GPU machines have no network, and one device call carries at most 64 MiB of ignored paths.
#
# Run from anywhere inside the repo, on a machine that reaches PyPI:   bash benchmarks/fa4_wheels.sh
# It writes (both git-ignored):
#   .whl/   every wheel except the second half of the large nvidia-cutlass-dsl-libs-<flavor> wheel, whose first
#           half is .whl/part.aa; plus BIGWHEEL (that wheel's file name) and SHA256SUMS (of every whole wheel)
#   .whl2/  part.ab, the second half
# benchmarks/README.md ("FA4 on the GPU machine") gives the two device commands that reassemble and install them.
#
# Target: the GPU image's python3 (CPython 3.12, x86_64, torch 2.11+cu130, driver 580 = CUDA 13.0). Packages that
# image already holds (torch, triton, numpy, einops, typing-extensions, protobuf, cuda-bindings, cuda-core,
# cuda-pathfinder, packaging, ...) are not downloaded; the script checks every Requires-Dist against that list and
# fails if something is neither downloaded nor known to be there.
#
# CUDA flavor of the CuTe DSL: cu12 by default. Its compiler is CUDA 12.9, which a CUDA 13.0 driver runs (the DSL
# only needs the driver, it links no CUDA runtime). The cu13 flavor's compiler is CUDA 13.4, newer than the
# machines' 13.0 driver. FA4_DSL_FLAVOR=cu13 picks it anyway (same size, same procedure).
set -euo pipefail

FA4_VERSION=${FA4_VERSION:-4.0.0b36}
DSL_VERSION=${DSL_VERSION:-4.8.1}
FLAVOR=${FA4_DSL_FLAVOR:-cu12}
# What a single device call may carry, with room for the repository itself.
CARRY_LIMIT_MIB=60

cd "$(git rev-parse --show-toplevel)"
rm -rf .whl .whl2
mkdir -p .whl .whl2

platforms=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done

download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$@"
}

download --pre "flash-attn-4==${FA4_VERSION}"
download "nvidia-cutlass-dsl==${DSL_VERSION}"
download "nvidia-cutlass-dsl-libs-base==${DSL_VERSION}"
download "nvidia-cutlass-dsl-libs-core==${DSL_VERSION}"
download "nvidia-cutlass-dsl-libs-${FLAVOR}==${DSL_VERSION}"
download "apache-tvm-ffi>=0.1.11,<0.2"
download torch-c-dlpack-ext
download "quack-kernels>=0.5.3"

# Every dependency must be downloaded above or already be on the GPU image (KINDS.md, "Python packages already
# there"). Extras (`; extra == ...`) and markers for Python < 3.11 do not apply.
on_gpu_image=" torch triton numpy einops typing-extensions typing_extensions protobuf cuda-bindings cuda-core
    cuda-pathfinder packaging "
missing=0
for w in .whl/*.whl; do
    deps=$(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra ==' \
        | grep -v 'python_version < "3.11"' || true)
    while read -r _ spec; do
        [ -n "${spec:-}" ] || continue
        name=$(printf '%s' "$spec" | sed -E 's/[ ;<>=!~(\[].*//' | tr '[:upper:]_' '[:lower:]-')
        norm=$(printf '%s' "$name" | tr '-' '_')
        if ls .whl/"${norm}"-*.whl >/dev/null 2>&1 || [[ "$on_gpu_image" == *" $name "* ]]; then
            continue
        fi
        echo "fa4_wheels: $(basename "$w") needs '$spec', which is neither downloaded nor on the GPU image" >&2
        missing=1
    done <<< "$deps"
done
[ "$missing" = 0 ] || exit 1

# (grep reads the whole listing: with -q it would stop early and, under pipefail, unzip's SIGPIPE fail the check)
unzip -l .whl/flash_attn_4-*.whl | grep 'flash_attn/cute/interface.py' > /dev/null \
    || { echo "fa4_wheels: flash_attn/cute/interface.py not in the flash-attn-4 wheel" >&2; exit 1; }

(cd .whl && sha256sum -- *.whl > SHA256SUMS)

# Split the largest wheel in two so that each carry stays under the limit.
big=$(ls -S .whl/*.whl | head -n 1)
basename "$big" > .whl/BIGWHEEL
size=$(stat -c %s "$big")
split -b $(( (size + 1) / 2 )) "$big" .whl/part.
rm "$big"
mv .whl/part.ab .whl2/part.ab
[ ! -e .whl/part.ac ] || { echo "fa4_wheels: split made more than two parts" >&2; exit 1; }

limit=$(( CARRY_LIMIT_MIB * 1024 * 1024 ))
for d in .whl .whl2; do
    bytes=$(du -sb "$d" | cut -f1)
    echo "$d: $(( bytes / 1024 / 1024 )) MiB"
    [ "$bytes" -lt "$limit" ] || { echo "fa4_wheels: $d is over ${CARRY_LIMIT_MIB} MiB" >&2; exit 1; }
done
ls -l .whl .whl2
echo "big wheel: $(cat .whl/BIGWHEEL)"
