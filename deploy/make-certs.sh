#!/usr/bin/env bash
# Makes a private CA, a server certificate, a client certificate and a
# token with the openssl command line, for tests and first deployments.
#
#   deploy/make-certs.sh [--group GROUP] OUTDIR [SERVER_NAME [DAYS]]
#
# OUTDIR gets ca.pem/ca.key, server.pem/server.key (subjectAltName
# DNS:SERVER_NAME, DNS:localhost, IP:127.0.0.1), client.pem/client.key
# (for mutual TLS) and token (32 random bytes, base64; an existing token
# is kept). SERVER_NAME defaults to localhost, DAYS to 365; a comma
# separated list (a,b,c) puts every name in the certificate, the first as
# its CN (the pods of a StatefulSet that share one Secret). A negative
# DAYS makes certificates that are already expired (for tests).
#
# Modes: certificates 0644. The secrets the server reads (server.key,
# token) are 0600 for the user who ran this, which is what systemd's
# LoadCredential= reads as root; with --group GROUP (a name or a numeric
# gid) they are 0640 and group GROUP, so a server running as a user of
# that group (the container's uid/gid 10001, the nogroup of a test) can
# read them and nobody else can. ca.key and client.key stay 0600 always:
# the server never reads them.
set -euo pipefail
usage="usage: make-certs.sh [--group GROUP] OUTDIR [SERVER_NAME [DAYS]]"
group=
case "${1:-}" in
  --group) group=${2:?$usage}; shift 2 ;;
  --group=*) group=${1#--group=}; shift ;;
esac
out=${1:?$usage}
name=${2:-localhost}
days=${3:-365}
IFS=, read -r -a names <<<"$name,"
sans=
for n in "${names[@]}"; do
  [ -n "$n" ] || { echo "make-certs.sh: an empty name in '$name'" >&2; exit 2; }
  sans+="DNS:$n,"
done
mkdir -p "$out"
cd "$out"
umask 077

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout ca.key -out ca.pem -days 3650 -subj "/CN=dispatch test CA" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

sign() { # $1 = basename, $2 = subject, $3 = extensions file
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
  if [ "$days" -lt 0 ]; then
    # expired on purpose: openssl ca can set both dates explicitly
    mkdir -p ca.db && : > ca.db/index.txt
    cat > ca.cnf <<CNF
[ca]
default_ca = d
[d]
database = ca.db/index.txt
new_certs_dir = ca.db
serial = ca.db/serial
default_md = sha256
policy = p
copy_extensions = none
[p]
commonName = supplied
CNF
    echo 01 > ca.db/serial
    openssl ca -batch -config ca.cnf -cert ca.pem -keyfile ca.key \
      -in "$1.csr" -out "$1.pem" -extfile "$3" -notext \
      -startdate 20200101000000Z -enddate 20210101000000Z 2>/dev/null
    rm -rf ca.db ca.cnf
  else
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key \
      -CAcreateserial -out "$1.pem" -days "$days" -extfile "$3" 2>/dev/null
  fi
  rm -f "$1.csr"
}

cat > server.ext <<EXT
subjectAltName=${sans}DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth
keyUsage=critical,digitalSignature
EXT
cat > client.ext <<EXT
extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature
EXT
sign server "/CN=${names[0]}" server.ext
sign client "/CN=dispatch client" client.ext
rm -f server.ext client.ext ca.srl
# base64 of random bytes: no newline or quote in it to trip a shell or YAML
[ -s token ] || head -c 32 /dev/urandom | base64 > token

chmod 0644 ca.pem server.pem client.pem
chmod 0600 ca.key client.key server.key token
if [ -n "$group" ]; then
  chgrp "$group" server.key token
  chmod 0640 server.key token
  # the group must reach the files: no "other" access is needed
  chgrp "$group" .
  chmod g+rx .
fi
echo "make-certs: wrote ca.pem server.pem server.key client.pem client.key token in $out"
