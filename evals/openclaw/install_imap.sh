#!/usr/bin/env bash
# Unpack Dovecot's IMAP server from Debian's packages for `freetoken-agent eval openclaw`.
#
#   evals/openclaw/install_imap.sh [PREFIX]      (default: <repo>/.clients)
#
# `apt-get download` and `dpkg -x` need no root: the packages are unpacked under PREFIX/dovecot/root
# and nothing is installed system-wide. The eval runs PREFIX/dovecot/root/usr/lib/dovecot/imap
# (evals/openclaw/imap.py). Pinned to Debian 12's dovecot 2.3.19.1.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PREFIX="${1:-${FREETOKEN_CLIENTS_DIR:-$REPO/.clients}}"
VERSION="1:2.3.19.1+dfsg1-2.1+deb12u6"
DIR="$PREFIX/dovecot"
if [[ -x "$DIR/root/usr/lib/dovecot/imap" ]]; then
  echo "[install] dovecot imap already unpacked in $DIR" >&2
  exit 0
fi
mkdir -p "$DIR/debs"
cd "$DIR/debs"
apt-get download "dovecot-core=$VERSION" "dovecot-imapd=$VERSION" >&2
for deb in ./*.deb; do
  dpkg -x "$deb" "$DIR/root"
done
echo "dovecot $DIR/root/usr/lib/dovecot/imap $VERSION"
