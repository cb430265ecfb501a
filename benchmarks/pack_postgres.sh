#!/usr/bin/env bash
# Packs this machine's Debian PostgreSQL into .pg/postgres.tar.xz for the GPU machine, which has
# none and cannot fetch one: the server, initdb, pg_ctl and createdb, the extensions Prefect's
# migrations create, and the shared libraries they link, but those any Debian or Ubuntu host
# with Python has (glibc, libstdc++, OpenSSL, zlib, liblzma, libffi, and what apt and systemd
# link: GnuTLS and its libraries, libgcrypt, libsystemd, zstd, lz4), to fit what travels. gpu_run.sh unpacks it
# there when .pg is carried, so the benchmarks' PostgreSQL rounds run.
#   bash benchmarks/pack_postgres.sh        # then carry [".whl", ".pg"]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
[ -n "$bin" ] || { echo "no /usr/lib/postgresql/*/bin here: apt-get install postgresql" >&2; exit 1; }
version=$(basename "$(dirname "$bin")")
lib=/usr/lib/postgresql/$version/lib
share=/usr/share/postgresql/$version
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

programs=("$bin"/{postgres,initdb,pg_ctl,createdb})
modules=("$lib"/{plpgsql,pg_trgm,dict_snowball,libpqwalreceiver,pgoutput}.so)
mapfile -d '' data < <(find "$share" -type f -not -path "$share/extension/*" -print0)
data+=("$share"/extension/{plpgsql,pg_trgm}*)
tar -cPf - "${programs[@]}" "${modules[@]}" "${data[@]}" | tar -xf - -C "$stage"
mkdir -p "$stage/pglibs"
ldd "${programs[@]}" "${modules[@]}" | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s|libssl|libcrypto|libz|liblzma|libffi)\.so' |
    grep -vE '/(libgnutls|libnettle|libhogweed|libgmp|libp11-kit|libtasn1|libidn2|libunistring|libsystemd|libgcrypt|libgpg-error|libzstd|liblz4)\.so' |
    xargs -I{} cp -L {} "$stage/pglibs/"
mkdir -p .pg
tar cf - -C "$stage" . | xz -9e -T0 > .pg/postgres.tar.xz
grep -qx '/.pg/' .git/info/exclude 2>/dev/null || echo /.pg/ >> .git/info/exclude
echo "PostgreSQL $version: .pg/postgres.tar.xz, $(du -h .pg/postgres.tar.xz | cut -f1)"
