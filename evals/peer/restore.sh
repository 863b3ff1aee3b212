#!/usr/bin/env bash
# restore.sh - reassemble binaries exported by `build.sh --export` into .peer/bin/.
#
# Contract: bash evals/peer/restore.sh DIR [DEST]
#   DIR holds NAME.xz.part-00, NAME.xz.part-01, ... (xz-compressed, split) and peer-bin.sha256;
#   for every NAME found, concatenates its parts in order, decompresses to DEST/NAME (default: the
#   repository's .peer/bin), checks it against peer-bin.sha256 when that lists NAME, and makes it
#   executable. Runs anywhere (the development machine, or the GPU machine with DIR carried there).
#   A binary whose shared libraries `ldd` does not find here (one built on another machine, its RUNPATH
#   naming that machine's CUDA) is kept as DEST/NAME.bin behind a wrapper DEST/NAME that sets
#   LD_LIBRARY_PATH to the folders holding them: those of $PEER_LIB_DIRS (colon-separated), then the
#   CUDA wheels of $PYTHON (default python3; torch's nvidia/*/lib), then /usr/local/cuda*/lib64; it
#   fails when a library is still missing (or a symbol version, as `ldd` says), leaving no DEST/NAME.
#   Exits non-zero when DIR has no parts, a checksum differs or a library cannot be found.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${1:?usage: restore.sh DIR [DEST]}"
DEST="${2:-$REPO/.peer/bin}"
mkdir -p "$DEST"
shopt -s nullglob
names=()
for part in "$DIR"/*.xz.part-00; do
    names+=("$(basename "$part" .xz.part-00)")
done
(( ${#names[@]} )) || { echo "restore.sh: no *.xz.part-00 in $DIR" >&2; exit 1; }
for name in "${names[@]}"; do
    parts=("$DIR/$name.xz.part-"*)
    cat "${parts[@]}" | xz -d > "$DEST/$name.tmp"
    if [[ -f "$DIR/peer-bin.sha256" ]] && grep -q " $name\$" "$DIR/peer-bin.sha256"; then
        want="$(grep " $name\$" "$DIR/peer-bin.sha256" | cut -d' ' -f1)"
        got="$(sha256sum "$DEST/$name.tmp" | cut -d' ' -f1)"
        [[ "$want" == "$got" ]] || { rm -f "$DEST/$name.tmp"; echo "restore.sh: $name: sha256 $got != $want" >&2; exit 1; }
    fi
    chmod +x "$DEST/$name.tmp"
    mv "$DEST/$name.tmp" "$DEST/$name"
    rm -f "$DEST/$name.bin"
    echo "restore.sh: $DEST/$name (${#parts[@]} parts, $(stat -c %s "$DEST/$name") bytes)"
    missing=$(ldd "$DEST/$name" 2>/dev/null | awk '/not found/ {sub(":$", "", $1); print $1}' | sort -u)
    [[ -z "$missing" ]] && continue
    lib_dirs=()  # the folders that hold the missing libraries, in the order of the contract
    cands=()
    IFS=: read -r -a cands <<< "${PEER_LIB_DIRS:-}"
    while IFS= read -r d; do cands+=("$d"); done < <("${PYTHON:-python3}" - <<'PY' 2>/dev/null
import glob, os, site
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for d in sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib")) + glob.glob(os.path.join(base, "nvidia", "*", "*", "lib"))):
        print(d)
PY
    )
    cands+=(/usr/local/cuda*/lib64 /usr/local/cuda*/targets/x86_64-linux/lib)
    for lib in $missing; do
        found=""
        for d in "${cands[@]}"; do
            [[ -n "$d" && -e "$d/$lib" ]] && { found=$d; break; }
        done
        [[ -n "$found" ]] || { rm -f "$DEST/$name"; echo "restore.sh: $name needs $lib, found in none of: ${cands[*]}" >&2; exit 1; }
        [[ " ${lib_dirs[*]} " == *" $found "* ]] || lib_dirs+=("$found")
    done
    libpath=$(IFS=:; echo "${lib_dirs[*]}")
    mv "$DEST/$name" "$DEST/$name.bin"
    printf '#!/bin/sh\n# restore.sh: %s built elsewhere; its libraries here\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$(dirname "$0")/%s.bin" "$@"\n' \
        "$name" "$libpath" "$name" > "$DEST/$name"
    chmod +x "$DEST/$name"
    ! LD_LIBRARY_PATH="$libpath" ldd "$DEST/$name.bin" | grep -q "not found" \
        || { rm -f "$DEST/$name" "$DEST/$name.bin"; echo "restore.sh: $name: still missing libraries with LD_LIBRARY_PATH=$libpath" >&2; exit 1; }
    echo "restore.sh: $DEST/$name runs $name.bin with LD_LIBRARY_PATH=$libpath (for $(echo $missing))"
done
