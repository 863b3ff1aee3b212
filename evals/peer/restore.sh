#!/usr/bin/env bash
# restore.sh - reassemble binaries exported by `build.sh --export` into .peer/bin/.
#
# Contract: bash evals/peer/restore.sh DIR [DEST]
#   DIR holds NAME.xz.part-00, NAME.xz.part-01, ... (xz-compressed, split) and peer-bin.sha256;
#   for every NAME found, concatenates its parts in order, decompresses to DEST/NAME (default: the
#   repository's .peer/bin), checks it against peer-bin.sha256 when that lists NAME, and makes it
#   executable. Runs anywhere (the development machine, or the GPU machine with DIR carried there).
#   Exits non-zero when DIR has no parts or a checksum differs.
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
    echo "restore.sh: $DEST/$name (${#parts[@]} parts, $(stat -c %s "$DEST/$name") bytes)"
done
