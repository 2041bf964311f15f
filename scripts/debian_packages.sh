#!/usr/bin/env bash
# Install the Debian packages named (those not installed yet) where this user can (root with
# apt-get); otherwise say which to install and go on: the tests that need them then say so.
# Usage: scripts/debian_packages.sh PACKAGE...
set -uo pipefail
missing=()
for package in "$@"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: install the Debian packages ${missing[*]} (apt-get install ${missing[*]}) as root;" \
       "the tests that need them fail until then" >&2
  exit 0
fi
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
install || { apt-get update -q >/dev/null && install; } || {
  echo "setup: apt-get could not install ${missing[*]}; the tests that need them fail until then" >&2; }
exit 0
